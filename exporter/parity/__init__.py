"""Parity: proving that every format computes what the TF session computes.

    plan.py         the parity plan an export stores (golden, exploration and stepped parts)
    reference.py    the TF session's side of the plan, computed at export
    replay.py       the plan replayed on each format (or candidate) fresh from disk
    compare.py      value-by-value comparison under per-output tolerances; the report
    exploration.py  sampled actions compared as distributions
    stepped.py      recurrent state carried over consecutive steps
    behaviour.py    lossy formats held to behavioural thresholds
    localize.py     the first intermediate tensor where an ONNX model leaves the frozen graph
"""
