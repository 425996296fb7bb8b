"""``keras``: the Keras base model on its own, as a Keras SavedModel, a ``.keras`` file and an
``.h5`` file under ``keras/``. It holds the base model, not the policy's signature, so it is
checked on the base model's inputs and outputs as the session computed them, each file under its
own name (``keras_saved_model``, ``keras_v3``, ``keras_h5``)."""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import Capabilities, Format

MODEL_IO_PREFIX = "base_model/"  # golden keys of the base model's inputs and outputs


class KerasFormat(Format):
    name = "keras"
    path = "keras"
    order = 50
    is_directory = True
    capabilities = Capabilities(signature=False, explores=False, steps_state=False, base_model=True)

    def skip_reason(self, policy) -> str | None:
        if policy.model is None:
            return "the policy has no Keras base model"
        return None

    def reference_passes(self, policy) -> int:
        return 0 if policy.model_io is None else 1

    def reference_outputs(self, policy, batched):
        """The base model's own inputs and outputs as the session computes them on the golden
        inputs, under :data:`MODEL_IO_PREFIX`."""
        if policy.model_io is None:
            return {}
        from policy_export.exporter.formats.keras.model import output_keys

        model_in, model_out = policy.model_io
        names = [t.name.split(":")[0] for t in policy.model.inputs]
        out_keys = output_keys(len(model_out))

        def run_io(batch):
            values = policy.session.run(list(model_in) + list(model_out),
                                        {policy.inputs[k]: v for k, v in batch.items()})
            ins = {f"{MODEL_IO_PREFIX}{n}": v for n, v in zip(names, values[: len(model_in)])}
            outs = {f"{MODEL_IO_PREFIX}{k}": v for k, v in zip(out_keys, values[len(model_in):])}
            return {**ins, **outs}

        return batched(run_io)

    def write(self, ctx, target: Path):
        from policy_export.exporter.formats.keras import model as keras_model

        return keras_model.write(ctx, target)

    def check(self, label, path: Path, manifest, device, replay, report) -> None:
        """Each Keras file on the base model's golden inputs, against the session's base model outputs."""
        from policy_export.exporter.formats.keras import model as keras_model

        golden = replay.plan.golden_outputs
        out_prefix = f"{MODEL_IO_PREFIX}{keras_model.MODEL_OUTPUT}"
        ins = {k[len(MODEL_IO_PREFIX):]: v for k, v in golden.items()
               if k.startswith(MODEL_IO_PREFIX) and not k.startswith(out_prefix)}
        reference = {k[len(MODEL_IO_PREFIX):]: v for k, v in golden.items() if k.startswith(out_prefix)}
        if not reference:
            return
        info = (manifest.get("formats") or {}).get(self.name) or {}
        for name, file in keras_model.FORMATS.items():  # one model in memory at a time
            with keras_model.KerasRunner(path / file, info.get("outputs"), device) as runner:
                replay.check_outputs(name, runner, ins, reference, report)


FORMAT = KerasFormat()
