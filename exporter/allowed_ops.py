"""Which ops graphs use and which of them :data:`~exporter.oplist.ALLOWED_OPS` lacks::

    python -m policy_export.exporter.allowed_ops --collect path/to/saved_model path/to/frozen_graph.pb
    python -m policy_export.exporter.allowed_ops --collect --serving path/to/rllib/saved_model

(``--serving``: only what the signature, the restore op and the init op need, as ``convert`` and
``inspect`` see it). The list itself is :mod:`exporter.oplist`; add an op there only after
checking what it does.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from policy_export.exporter.oplist import ALLOWED_OPS  # noqa: F401 (re-exported)


def graph_ops(path: str | Path, serving: bool = False, signature_key: str = "serving_default",
              ) -> dict[str, set[str]]:
    """The ops of the graphs at ``path``, each with where it occurs (``graph`` or ``function NAME``).

    ``path`` is a SavedModel directory (every meta graph, every library function; with
    ``serving``, only what :func:`exporter.trust.prune_to_serving` keeps for ``signature_key``)
    or a frozen ``GraphDef`` file. Nothing is loaded into TensorFlow.

    Returns:
        op name -> places it occurs; library function names used as ops are not listed.
    Raises:
        ExportError: ``path`` cannot be read.
    """
    from policy_export.exporter import trust

    path = Path(path)
    if path.is_dir():
        metas = trust.read_saved_model(path).meta_graphs
        graphs = [(trust.prune_to_serving(m, signature_key, str(path)) if serving else m).graph_def for m in metas]
    else:
        graphs = [trust.read_graph_def(path)]
    return ops_of(graphs)


def ops_of(graph_defs: Iterable) -> dict[str, set[str]]:
    """Op name -> where it occurs, over the main graphs and every library function of ``graph_defs``."""
    out: dict[str, set[str]] = defaultdict(set)
    for graph_def in graph_defs:
        functions = {f.signature.name for f in graph_def.library.function}
        for node in graph_def.node:
            if node.op not in functions:
                out[node.op].add("graph")
        for fn in graph_def.library.function:
            for node in fn.node_def:
                if node.op not in functions:
                    out[node.op].add(f"function {fn.signature.name}")
    return dict(out)


def missing(ops: Iterable[str]) -> list[str]:
    """The ops of ``ops`` that are neither on :data:`ALLOWED_OPS` nor checkpoint ops (which
    :mod:`exporter.trust` checks by where they are), sorted."""
    from policy_export.exporter.trust import RESTORE_OPS, SAVE_OPS

    return sorted(set(ops) - ALLOWED_OPS - SAVE_OPS - RESTORE_OPS)


def main(argv: list[str] | None = None) -> int:
    """``--collect PATH...``: print every op of the graphs with its use count, then the ones the
    list lacks. Returns 1 when some are missing, else 0."""
    parser = argparse.ArgumentParser(prog="python -m policy_export.exporter.allowed_ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collect", nargs="+", metavar="PATH", required=True,
                        help="SavedModel directories or frozen graph files")
    parser.add_argument("--serving", action="store_true", help="only the serving subgraph of each SavedModel")
    parser.add_argument("--signature", default="serving_default")
    args = parser.parse_args(argv)
    found: dict[str, set[str]] = defaultdict(set)
    for path in args.collect:
        for op, places in graph_ops(path, args.serving, args.signature).items():
            found[op].update(f"{path}: {p}" for p in places)
    for op in sorted(found):
        mark = "" if op not in missing([op]) else "   <- NOT ALLOWED"
        sys.stdout.write(f"{op}  ({len(found[op])} places){mark}\n")
    lacking = missing(found)
    for op in lacking:
        sys.stdout.write(f"missing: {op}  e.g. {sorted(found[op])[0]}\n")
    return 1 if lacking else 0


if __name__ == "__main__":
    sys.exit(main())
