"""What comes in: each module turns one kind of input into a :class:`policy.TFPolicy`.

    legacy.py     a TF1 SavedModel with a policy signature (RLlib <= 2.0 ``export_model``)
    keras.py      a Keras base-model SavedModel (RLlib >= 2.1 ``export_model``), action head rebuilt
    rllib.py      a live RLlib TF policy (``from_rllib``)
    lstm_step.py  a recurrent loop in the graph rebuilt as one cell step

A spec file (``policy.json``) is read by :mod:`policy.spec` and built by :class:`policy.TFPolicy`.
"""
