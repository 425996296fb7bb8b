"""The references a parity plan's groups are made from: what says what the right outputs are.

    session.py     the policy's own TF session (an export this package builds)
    recording.py   a recording of what the training framework computed (a policy exported elsewhere)
"""
