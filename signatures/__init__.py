"""SignatureDef construction and the I/O contract of an exported policy."""

from policy_export.signatures.contract import Contract, TensorSpec

__all__ = ["Contract", "TensorSpec", "Signature", "build_signature"]


def __getattr__(name: str):
    if name in ("Signature", "build_signature", "SERVING_KEY"):
        from policy_export.signatures import builder

        return getattr(builder, name)
    raise AttributeError(f"module 'signatures' has no attribute {name!r}")
