"""TFPolicy: a tf.compat.v1 graph and session computing a policy's actions.

Build one from a spec, or wrap a session and tensors you already have::

    policy = TFPolicy.from_spec(load_spec("fixtures/cartpole_mlp"))
    result = policy.compute_actions(obs_batch)           # deterministic unless explore=True
    result.actions, result.fetches[ACTION_LOGP]

    policy = TFPolicy(obs_space, act_space, sess,
                      observations=obs_ph, sampled_action=action_t, action_logp=logp_t)

Inputs and outputs are keyed by their signature keys (``observations``, ``explore``,
``actions_0``, ``action_logp``...); see ``signatures.build_signature``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf
from policy_export.policy import h5io
from policy_export.policy.distributions import SUPPORTED_ACTION_SPACES, ActionDistribution
from policy_export.policy.exact import exact_cast
from policy_export.policy.head import action_head
from policy_export.errors import InputError, PolicyExportError, WeightsError
from policy_export.policy.graph import (  # noqa: F401  (re-exported: the policy's public vocabulary)
    ACTION_DIST_INPUTS,
    ACTION_LOGP,
    ACTION_PROB,
    ActionResult,
    deterministic_path,
    session_config,
    unflatten,
)
from policy_export.policy.models import build_model, model_inputs, named_weights, preprocess
from policy_export.policy.spaces import check_supported, leaf_dtype, leaf_shape, leaf_values, leaves
from policy_export.policy.spec import PolicySpec, with_names_hint
from policy_export.signatures.keys import action_key, is_action, is_state_in, state_in_key, state_out_key

tf1 = tf.compat.v1
log = logging.getLogger(__name__)

from policy_export.signatures.keys import (  # noqa: E402,F401 (re-exported)
    EXPLORE, IS_TRAINING, OBSERVATIONS, PREV_ACTION, PREV_REWARD, SEQ_LENS, TIMESTEP,
)
SUPPORTED_OBSERVATION_SPACES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)


class TFPolicy:
    """A policy as graph tensors in a ``tf.compat.v1.Session``.

    Args:
        observation_space, action_space: the gymnasium spaces.
        session: the session holding the graph and variable values.
        observations: the observation placeholder, or a mapping leaf key -> placeholder
            (keys ``observations/<nest path>``) for Dict/Tuple spaces.
        sampled_action: the action tensor, or a list of them in flatten order (``actions_0..``).
        action_logp, action_prob, action_dist_inputs: optional output tensors; ``action_prob``
            is derived as ``exp(action_logp)`` when only the log-probability is given.
        explore, is_training, timestep: optional placeholders (``placeholder_with_default`` makes
            them optional inputs with that default).
        extra_inputs, extra_fetches: further inputs and outputs, keyed by signature key.
        model: the Keras base model, if any (its weights are the policy's weights).
        model_io: (inputs, outputs) tensors of the base model inside the policy graph, used to
            check the standalone Keras files against the session.
        raw_actions: the sampled actions before post-processing (clipping), one per action leaf;
            feeding them lets parity ask the session for the log-probability of given actions.
        image_inputs: keys of the inputs that are HxWxC images (what ``inputs_as_nchw``
            transposes); default: the rank-4 uint8 inputs.
        state_inputs, state_outputs: recurrent state tensors, keyed ``state_in_i``/``state_out_i``
            (never by tensor name); ``seq_lens`` is then required.
        prev_action, prev_reward: the previous step's action and reward, when the model uses them.
        sequence_graph: the training-time graph over padded sequences (``compute_actions`` runs
            it for recurrent policies); the signature tensors above are the one-step serving graph.
        deterministic_outputs: the outputs computed on the deterministic path alone (no random
            ops, no explore switch), keyed like ``outputs``; what ``model_deterministic.onnx`` holds.
    """

    # mirrors RLlib's TFPolicy constructor (its tensors passed by name), plus the package's own parts
    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        session: tf1.Session,
        *,
        observations: tf.Tensor | Mapping[str, tf.Tensor],
        sampled_action: tf.Tensor | Sequence[tf.Tensor],
        action_logp: tf.Tensor | None = None,
        action_prob: tf.Tensor | None = None,
        action_dist_inputs: tf.Tensor | None = None,
        explore: tf.Tensor | None = None,
        is_training: tf.Tensor | None = None,
        timestep: tf.Tensor | None = None,
        extra_inputs: Mapping[str, tf.Tensor] | None = None,
        extra_fetches: Mapping[str, tf.Tensor] | None = None,
        model: Any = None,
        model_io: tuple[Sequence[tf.Tensor], Sequence[tf.Tensor]] | None = None,
        raw_actions: Sequence[tf.Tensor] | None = None,
        image_inputs: Sequence[str] | None = None,
        state_inputs: Sequence[tf.Tensor] = (),
        state_outputs: Sequence[tf.Tensor] = (),
        seq_lens: tf.Tensor | None = None,
        prev_action: tf.Tensor | None = None,
        prev_reward: tf.Tensor | None = None,
        sequence_graph: Any = None,
        deterministic_outputs: Mapping[str, tf.Tensor] | None = None,
        name: str = "policy",
    ):
        self.observation_space = observation_space
        self.action_space = action_space
        self.session = session
        self.graph = session.graph
        self.model = model
        self.model_io = model_io
        self.raw_actions = list(raw_actions) if raw_actions is not None else None
        self.name = name
        # why the export serves no exploring path, when a source could not make one stateless
        self.explore_refused: str | None = None

        self.inputs = _inputs(observations, state_inputs, state_outputs, seq_lens, prev_action, prev_reward,
                              explore, is_training, timestep, extra_inputs)
        self.sequence_graph = sequence_graph
        self.deterministic_outputs = dict(deterministic_outputs) if deterministic_outputs else None

        self.outputs = self._outputs(sampled_action, state_outputs, action_dist_inputs, action_logp, action_prob,
                                     extra_fetches)
        self.unused_inputs = self._drop_unused_inputs([PREV_ACTION, PREV_REWARD, *(extra_inputs or {})])
        self.defaults: dict[str, np.ndarray] = self._read_defaults()
        if image_inputs is None:
            image_inputs = [k for k, t in self.inputs.items() if t.shape.rank == 4 and t.dtype == tf.uint8]
        unknown = [k for k in image_inputs if k not in self.inputs or self.inputs[k].shape.rank != 4]
        if unknown:
            raise PolicyExportError(f"image_inputs {unknown} are not rank-4 (batch, H, W, C) inputs of the policy")
        self.image_inputs = list(image_inputs)
        self._variables = self._weight_variables()

    def _drop_unused_inputs(self, optional: list[str]) -> list[str]:
        """Leave out the ``optional`` inputs no output reads (RLlib's signatures carry
        prev_action/prev_reward for every model): a client feeding what the policy needs must not
        fail for them. Returns their keys."""
        unused = _unused_inputs({k: t for k, t in self.inputs.items() if k in optional},
                                [*self.outputs.values(), *(self.deterministic_outputs or {}).values()])
        for key in unused:
            del self.inputs[key]
        return unused

    def _outputs(self, sampled_action, state_outputs, action_dist_inputs, action_logp, action_prob,
                 extra_fetches) -> dict[str, tf.Tensor]:
        """The output tensors keyed like the contract (``action_prob`` made from ``action_logp`` if absent)."""
        actions = list(sampled_action) if isinstance(sampled_action, (list, tuple)) else [sampled_action]
        outputs: dict[str, tf.Tensor] = {action_key(i): a for i, a in enumerate(actions)}
        if action_prob is None and action_logp is not None:
            with self.graph.as_default():
                action_prob = tf.exp(action_logp, name=ACTION_PROB)
        for i, tensor in enumerate(state_outputs):
            outputs[state_out_key(i)] = tensor
        for key, tensor in (
            (ACTION_DIST_INPUTS, action_dist_inputs), (ACTION_LOGP, action_logp), (ACTION_PROB, action_prob),
        ):
            if tensor is not None:
                outputs[key] = tensor
        for key, tensor in (extra_fetches or {}).items():
            if key in outputs:
                raise PolicyExportError(f"extra fetch {key!r} clashes with a built-in output key")
            outputs[key] = tensor
        return outputs

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_spec(cls, spec: PolicySpec, device: str | None = None) -> "TFPolicy":
        """Build the graph and session for ``spec`` and load its weights (or initialise from its seed).

        ``device`` is a TF device string such as ``"/GPU:0"`` or ``"/CPU:0"``; ``None`` lets TF place ops.

        Raises:
            UnsupportedSpaceError: a space the model cannot take.
            WeightsError: the weights file does not fit (see :meth:`import_model_from_h5`).
        """
        check_supported(spec.observation_space, "observation_space", SUPPORTED_OBSERVATION_SPACES)
        check_supported(spec.action_space, "action_space", SUPPORTED_ACTION_SPACES)
        if spec.model.lstm is not None:
            from policy_export.policy.recurrent import build_recurrent_policy

            return build_recurrent_policy(cls, spec, device)
        num_outputs = ActionDistribution.required_inputs(spec.action_space)
        specs = model_inputs(spec.observation_space, spec.model)

        graph = tf.Graph()
        with graph.as_default(), tf.device(device):
            tf1.set_random_seed(spec.seed)
            obs_ph = {}
            for leaf in leaves(spec.observation_space):
                key = leaf.key(OBSERVATIONS)
                obs_ph[key] = tf1.placeholder(
                    tf.as_dtype(leaf_dtype(leaf.space)), (None, *leaf_shape(leaf.space)), name=key
                )
            explore = tf1.placeholder_with_default(False, (), name=EXPLORE)
            is_training = tf1.placeholder_with_default(False, (), name=IS_TRAINING)
            timestep = tf1.placeholder_with_default(np.int64(0), (), name=TIMESTEP)
            with tf1.name_scope("preprocess"):
                model_in = [preprocess(leaf, t, s)
                            for leaf, t, s in zip(leaves(spec.observation_space), obs_ph.values(), specs)]
            model = build_model(specs, spec.model, num_outputs, seed=spec.seed)
            dist_inputs = tf.identity(model(model_in if len(model_in) > 1 else model_in[0]), name=ACTION_DIST_INPUTS)
            head = action_head(spec.action_space, dist_inputs, explore)
            init = tf1.global_variables_initializer()
        session = tf1.Session(graph=graph, config=session_config(device))
        session.run(init)
        policy = cls(
            spec.observation_space, spec.action_space, session,
            observations=obs_ph, sampled_action=head.actions, action_logp=head.action_logp,
            action_dist_inputs=dist_inputs, explore=explore, is_training=is_training, timestep=timestep,
            model=model, model_io=(model_in, [dist_inputs]), raw_actions=head.raw_actions, name=spec.name,
            deterministic_outputs=head.deterministic,
            image_inputs=[k for k, s in zip(obs_ph, specs) if s.image],
        )
        if spec.weights is not None:
            policy.import_model_from_h5(spec.weights)
        return policy

    # ------------------------------------------------------------------ running

    def run(self, feeds: Mapping[str, Any], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run the session: ``feeds`` and the result are keyed by signature key.

        Optional inputs may be left out (their defaults apply). ``outputs`` defaults to all.

        Raises:
            InputError: an unknown key, a missing required input, or an array of the wrong shape/dtype.
        """
        outputs = list(self.outputs) if outputs is None else list(outputs)
        unknown = [k for k in outputs if k not in self.outputs]
        if unknown:
            raise InputError(f"unknown output(s) {unknown}; the policy has {list(self.outputs)}")
        feed_dict = {self.inputs[k]: v for k, v in self.check_feeds(feeds).items()}
        values = self.session.run([self.outputs[k] for k in outputs], feed_dict)
        return dict(zip(outputs, values))

    def check_feeds(self, feeds: Mapping[str, Any], inputs: Mapping[str, tf.Tensor] | None = None,
                    same_batch: bool = True) -> dict[str, np.ndarray]:
        """Validate and cast ``feeds`` to the input dtypes (of ``inputs``, default the signature's).

        Raises:
            InputError: an unknown or missing input, a dtype that cannot be cast safely, a wrong
                shape, or (with ``same_batch``) inputs of different batch sizes.
        """
        inputs = self.inputs if inputs is None else inputs
        unknown = sorted(set(feeds) - set(inputs))
        if unknown:
            raise InputError(f"unknown input(s) {unknown}; the policy takes {list(inputs)}")
        missing = [k for k, t in inputs.items() if k not in feeds and t.op.type != "PlaceholderWithDefault"]
        if missing:
            raise InputError(f"missing required input(s) {missing}")
        out = {}
        batch = None
        for key, value in feeds.items():
            tensor = inputs[key]
            arr = np.asarray(value)
            want = tensor.dtype.as_numpy_dtype
            if arr.dtype != want:
                if not _safe_cast(arr, np.dtype(want)):
                    raise InputError(f"input {key!r}: dtype {arr.dtype} cannot be safely cast to {np.dtype(want).name}")
                arr = arr.astype(want)
            shape = tensor.shape
            if shape.rank is not None:
                ok = arr.ndim == shape.rank and all(
                    d is None or d == a for d, a in zip(shape.as_list(), arr.shape)
                )
                if not ok:
                    raise InputError(f"input {key!r}: expected shape {_fmt_shape(shape.as_list())}, got {list(arr.shape)}")
                if same_batch and shape.rank and shape.as_list()[0] is None:
                    if batch is not None and arr.shape[0] != batch:
                        raise InputError(f"input {key!r}: batch size {arr.shape[0]} differs from {batch}")
                    batch = arr.shape[0]
            out[key] = arr
        return out

    @property
    def sequence_graph_chunk(self) -> int:
        """The padded sequence length the training-time graph is run with (``max_seq_len``)."""
        return getattr(self.sequence_graph, "max_seq_len", 20)

    @property
    def is_recurrent(self) -> bool:
        return any(is_state_in(k) for k in self.inputs)

    def get_initial_state(self) -> list[np.ndarray]:
        """One zero array per state input, for a single sequence (shape ``[cell]``)."""
        return [np.zeros(t.shape.as_list()[1:], t.dtype.as_numpy_dtype)
                for k, t in self.inputs.items() if is_state_in(k)]

    def compute_actions(self, obs: Any, state: Sequence[np.ndarray] | None = None, prev_action: Any = None,
                        prev_reward: Any = None, seq_lens: Any = None, explore: bool = False,
                        timestep: int | None = None) -> ActionResult:
        """Actions for a batch of observations (an array, or a dict/tuple nest for nested spaces).

        Recurrent policies run the training-time graph: ``obs`` (and ``prev_action``/``prev_reward``)
        hold ``B`` padded sequences of ``T`` steps flattened to ``B*T`` rows, ``seq_lens`` gives each
        sequence's length (default: ``B`` one-step sequences), ``state`` the ``B`` initial states
        (default zeros). ``result.state_out`` holds the states after each sequence's last step.
        """
        if self.is_recurrent:
            from policy_export.policy.recurrent import compute_sequence_actions

            return compute_sequence_actions(self, obs, state, prev_action, prev_reward, seq_lens, explore, timestep)
        feeds = self.observation_feeds(obs)
        if EXPLORE in self.inputs:
            feeds[EXPLORE] = np.bool_(explore)
        elif explore:
            raise InputError("this policy has no explore input")
        if timestep is not None and TIMESTEP in self.inputs:
            feeds[TIMESTEP] = np.int64(timestep)
        fetches = self.run(feeds)
        actions = [fetches[k] for k in self.outputs if is_action(k)]
        return ActionResult(actions=unflatten(self.action_space, actions), fetches=fetches)

    def observation_feeds(self, obs: Any) -> dict[str, np.ndarray]:
        """Split an observation batch (array or dict/tuple nest) into leaf feeds keyed by signature key."""
        try:
            return leaf_values(self.observation_space, obs, OBSERVATIONS)
        except KeyError as e:
            raise InputError(f"observation has no entry {e.args[0]!r}") from None

    # ------------------------------------------------------------------ weights

    def get_weights(self) -> dict[str, np.ndarray]:
        """The policy's weights keyed ``layer/weight`` (base model) or by variable name."""
        values = self.session.run([v for _, v in self._variables])
        return {k: np.asarray(v) for (k, _), v in zip(self._variables, values)}

    def set_weights(self, weights: Mapping[str, np.ndarray], allow_non_finite: bool = False) -> None:
        """Assign all weights in one session run, after checking every key, shape and value.

        Raises:
            WeightsError: naming every missing, unexpected, misshapen or non-finite weight;
                nothing is assigned then.
        """
        self._assign(self._check_weights(weights, "weights", allow_non_finite))

    def import_model_from_h5(self, path: str | Path, allow_non_finite: bool = False) -> None:
        """Load base-model weights from an h5 file, matched by layer and weight name.

        Every weight's presence and shape is checked before anything is assigned; on any error
        the policy's weights are exactly as before.

        The names are those of the spec's model (``fc_1/kernel``, ``fc_out/bias``, ``lstm/kernel``,
        ``obs_<key>_conv_1/kernel``...: docs/spec.md, "Layer and weight names");
        ``write_weights_template`` writes a file that holds exactly them, to fill in.

        Raises:
            WeightsError: unreadable file, or every weight that is missing, extra or misshapen
                (with a hint when the file's names are not the policy's).
        """
        # weights the policy does not expect, or of another shape, are reported without being read
        shapes = {key: tuple(var.shape.as_list()) for key, var in self._variables}
        weights = h5io.read_h5_weights(path, expected_shapes=shapes)
        try:
            assignments = self._check_weights(weights, str(path), allow_non_finite)
        except WeightsError as e:
            raise with_names_hint(e, shapes, {k: tuple(np.shape(v)) for k, v in weights.items()}) from None
        self._assign(assignments)

    def import_model_from_tf1_checkpoint(self, path: str | Path, allow_non_finite: bool = False) -> None:
        """Load weights from a ``tf.compat.v1.train.Saver`` checkpoint (its prefix, ``.index`` or
        directory), matched by TF variable name, read without TensorFlow's checkpoint reader.

        Checked like :meth:`import_model_from_h5`: every weight present, of its shape, finite;
        on any error the policy's weights are exactly as before. Checkpoint entries the policy does
        not hold (optimizer slots, counters) are left alone.

        Raises:
            WeightsError: every weight that is missing or misshapen.
            UnsafeCheckpointError: files the reader refuses (see :mod:`policy.bundleio`).
        """
        from policy_export.policy.bundleio import bundle_entries, checkpoint_prefix, read_bundle

        prefix = checkpoint_prefix(path)
        _, entries = bundle_entries(prefix)
        by_name = {var.op.name: key for key, var in self._variables}
        present = [name for name in by_name if name in entries and entries[name].dtype is not None]
        weights = {by_name[name]: value for name, value in read_bundle(prefix, present).items()}
        self._assign(self._check_weights(weights, str(prefix), allow_non_finite))

    def export_weights_h5(self, path: str | Path) -> Path:
        """Write the base model's weights to ``path`` in Keras's h5 weights layout."""
        return h5io.write_h5_weights(path, self.get_weights())

    def _check_weights(self, weights: Mapping[str, np.ndarray], source: str, allow_non_finite: bool) -> list:
        problems = []
        assignments = []
        expected = dict(self._variables)
        for key in expected:
            if key not in weights:
                problems.append(f"missing weight {key!r}")
        for key, value in weights.items():
            if key not in expected:
                problems.append(f"unexpected weight {key!r} (the policy has no such layer weight)")
                continue
            var = expected[key]
            arr = np.asarray(value)
            want = tuple(var.shape.as_list())
            if arr.shape != want:
                problems.append(f"weight {key!r} has shape {list(arr.shape)}, the policy expects {list(want)}")
                continue
            if arr.dtype.kind not in "fiu" or arr.dtype.fields is not None:
                problems.append(f"weight {key!r} has dtype {arr.dtype}; weights are real numbers (float or "
                                "integer) and are never cast from complex, bool, string or other data")
                continue
            if not allow_non_finite and not np.all(np.isfinite(arr)):
                problems.append(f"weight {key!r} holds NaN or Inf values")
                continue
            value, problem = exact_cast(arr, np.dtype(var.dtype.as_numpy_dtype))
            if problem is not None:
                problems.append(f"weight {key!r} {problem}")
                continue
            assignments.append((var, value))
        if problems:
            raise WeightsError(source, problems)
        return assignments

    def _assign(self, assignments: list) -> None:
        # Feeding each variable's initial value into its initializer assigns it without adding
        # ops to the graph; all variables are assigned in one run.
        ops = [var.initializer for var, _ in assignments]
        feeds = {var.initializer.inputs[1]: value for var, value in assignments}
        self.session.run(ops, feeds)

    def _weight_variables(self) -> list[tuple[str, Any]]:
        if self.model is not None:
            return named_weights(self.model)
        with self.graph.as_default():
            variables = tf1.global_variables()
        return [(v.name.split(":")[0], v) for v in variables]

    def _read_defaults(self) -> dict[str, np.ndarray]:
        defaults = {}
        for key, tensor in self.inputs.items():
            if tensor.op.type == "PlaceholderWithDefault":
                defaults[key] = np.asarray(self.session.run(tensor.op.inputs[0]))
        return defaults

    def close(self) -> None:
        """Close the session."""
        self.session.close()


def _safe_cast(arr: np.ndarray, want: np.dtype) -> bool:
    if np.can_cast(arr.dtype, want, casting="same_kind"):
        if np.issubdtype(want, np.integer) and np.issubdtype(arr.dtype, np.integer):
            info = np.iinfo(want)
            return arr.size == 0 or (arr.min() >= info.min and arr.max() <= info.max)
        return True
    if np.issubdtype(arr.dtype, np.integer) and np.issubdtype(want, np.floating):
        return True
    if arr.dtype == np.bool_ and np.issubdtype(want, np.integer):
        return True
    return False


def _fmt_shape(dims: Sequence[int | None]) -> str:
    return "[" + ", ".join("batch" if d is None else str(d) for d in dims) + "]"


def _unused_inputs(inputs: Mapping[str, tf.Tensor], outputs: Sequence[tf.Tensor]) -> list[str]:
    """The keys of ``inputs`` that no tensor of ``outputs`` depends on, through data or control
    edges (while loops included)."""
    candidates = {t.op.name: key for key, t in inputs.items()}
    if not candidates:
        return []
    seen: set[str] = set()
    todo = [t.op for t in outputs]
    while todo and len(seen & candidates.keys()) < len(candidates):
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return sorted(key for name, key in candidates.items() if name not in seen)


# mirrors RLlib's TFPolicy constructor: its input tensors by name
def _inputs(observations, state_inputs, state_outputs, seq_lens, prev_action, prev_reward, explore, is_training,
            timestep, extra_inputs) -> dict[str, tf.Tensor]:
    """The input tensors keyed like the contract."""
    inputs: dict[str, tf.Tensor] = {}
    if isinstance(observations, Mapping):
        inputs.update(observations)
    else:
        inputs[OBSERVATIONS] = observations
    if len(state_inputs) != len(state_outputs):
        raise PolicyExportError(f"{len(state_inputs)} state inputs but {len(state_outputs)} state outputs")
    if state_inputs and seq_lens is None:
        raise PolicyExportError("a recurrent policy needs a seq_lens input")
    for i, tensor in enumerate(state_inputs):
        inputs[state_in_key(i)] = tensor
    for key, tensor in ((SEQ_LENS, seq_lens), (PREV_ACTION, prev_action), (PREV_REWARD, prev_reward),
                        (EXPLORE, explore), (IS_TRAINING, is_training), (TIMESTEP, timestep)):
        if tensor is not None:
            inputs[key] = tensor
    inputs.update(extra_inputs or {})
    return inputs
