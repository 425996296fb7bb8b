"""policy.json's JSON Schema agrees with the loader; weights templates; the names a weights file must hold.

Every spec file in the repository validates against the schema and loads; each invalid spec below
(a valid one with one thing changed) is refused by both; what the schema cannot say is listed
(and documented in docs/spec.md). The layer/weight table in docs/spec.md is a real build's.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import tomllib

import h5py
import jsonschema
import numpy as np
import pytest

from conftest import FIXTURES, FIXTURES_DIR, ROOT
from policy_export.errors import SpecError, UnsupportedSpaceError, WeightsError
from policy_export.policy import spaces as spaces_mod
from policy_export.policy import spec as spec_mod
from policy_export.policy.h5io import read_h5_weights
from policy_export.policy.spec import SCHEMA_FILE, load_spec, spec_from_json
from policy_export.policy.template import weight_shapes, write_weights_template

SCHEMA = json.loads(SCHEMA_FILE.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
DOCS = ROOT / "docs" / "spec.md"
class _Delete:
    """Stands for "remove this key" in a variation (its repr is stable, so parametrized ids agree
    between pytest-xdist workers)."""

    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()

# one spec with every construct the loader knows (it loads; it is not built)
BASE = {
    "format_version": 1,
    "name": "every-construct",
    "observation_space": {"type": "Dict", "spaces": {
        "camera": {"type": "Box", "low": 0, "high": 255, "shape": [16, 16, 3], "dtype": "uint8"},
        "state": {"type": "Box", "low": [-1, "-inf"], "high": [1, "inf"], "dtype": "float32"},
        "mode": {"type": "Discrete", "n": 3, "start": -1},
        "keys": {"type": "MultiDiscrete", "nvec": [2, 3]},
        "flags": {"type": "MultiBinary", "n": [2, 2]},
        "pair": {"type": "Tuple", "spaces": [{"type": "Discrete", "n": 2},
                                             {"type": "Box", "low": -1, "high": 1, "shape": [2]}]},
    }},
    "action_space": {"type": "Tuple", "spaces": [
        {"type": "Discrete", "n": 3}, {"type": "Box", "low": -2, "high": 2, "shape": [2], "dtype": "float32"}]},
    "model": {"hiddens": [32, 32], "activation": "relu", "conv_filters": [[8, [3, 3], 2]],
              "lstm": {"cell_size": 16, "max_seq_len": 8, "use_prev_action": True, "use_prev_reward": True}},
    "seed": 7,
}
OBS = ("observation_space", "spaces")
CAMERA, STATE, MODE = OBS + ("camera",), OBS + ("state",), OBS + ("mode",)
KEYS, FLAGS = OBS + ("keys",), OBS + ("flags",)
PAIR, ACT_BOX = OBS + ("pair",), ("action_space", "spaces", 1)


def mutate(path: tuple, value, obj=None):
    """A deep copy of ``obj`` (default BASE) with ``path`` set to ``value`` (``DELETE`` removes it)."""
    out = copy.deepcopy(BASE if obj is None else obj)
    node = out
    for part in path[:-1]:
        node = node[part]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def json_path(path: tuple) -> str:
    """The loader's form of a path: ``$.a.b[0]``."""
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def load(obj):
    """Load ``obj`` with the loader (relative weights against the cartpole_mlp fixture, which has a weights file)."""
    return spec_from_json(obj, base_dir=FIXTURES_DIR / "cartpole_mlp", source="<test>")


def spec_files() -> list:
    """Every spec file in the repository: fixtures/*/policy.json, any other spec JSON under fixtures/,
    and the specs the package ships."""
    found = []
    for file in [*sorted(FIXTURES_DIR.rglob("*.json")), *sorted((ROOT / "policy_export").rglob("policy.json"))]:
        try:
            obj = json.loads(file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if file.name == "policy.json" or (isinstance(obj, dict) and "format_version" in obj and "model" in obj):
            found.append(file)
    return found


# --------------------------------------------------------------------------- valid specs


def test_the_schema_is_a_valid_draft_2020_12_schema():
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_every_spec_file_validates_and_loads():
    files = spec_files()
    assert {f.parent.name for f in files} >= set(FIXTURES)
    for file in files:
        errors = [e.message for e in VALIDATOR.iter_errors(json.loads(file.read_text()))]
        assert not errors, f"{file}: {errors}"
        load_spec(file)


def test_the_docs_example_validates_and_loads():
    example = json.loads(re.search(r"```json\n(.*?)```", DOCS.read_text(), re.S).group(1))
    assert not list(VALIDATOR.iter_errors(example))
    load(example)


@pytest.mark.parametrize("path, value", [
    (("$schema",), "./policy.schema.json"),
    (("$schema",), "https://json-schema.org/draft/2020-12/schema"),
    (("weights",), None),
    (("weights",), "weights.h5"),
    (("weights",), "./weights.h5"),
    (("seed",), DELETE),
    (("seed",), 2**31 - 1),
    (("model",), {}),
    (("model", "lstm"), None),
    (("model", "lstm"), {}),
    (("model", "hiddens"), []),
    (("model", "conv_filters"), []),
    (("model", "activation"), "linear"),
    (MODE + ("start",), -(2**40)),
    (MODE + ("start",), DELETE),
    (STATE + ("low",), ["-Infinity", "+inf"]),
    (STATE + ("dtype",), DELETE),
    (PAIR + ("spaces", 1), {"type": "Box", "low": -65504, "high": 65519, "shape": [2], "dtype": "float16"}),
    (PAIR + ("spaces", 1, "shape"), []),
    (CAMERA + ("low",), 0.0),
    (ACT_BOX + ("dtype",), "float64"),
    (ACT_BOX, {"type": "Box", "low": -1e300, "high": 1e300, "shape": [2], "dtype": "float64"}),
    (FLAGS + ("n",), 4),
    (OBS + ("a.b-c_1",), {"type": "Discrete", "n": 2}),
    (("action_space",), {"type": "Box", "low": -(2**63), "high": 2**63 - 1, "shape": [1], "dtype": "int64"}),
], ids=lambda v: repr(v)[:40])
def test_valid_variations_pass_both(path, value):
    obj = mutate(path, value)
    assert not [e.message for e in VALIDATOR.iter_errors(obj)]
    load(obj)


# --------------------------------------------------------------------------- invalid specs

INVALID = [
    # top level
    *[((key,), DELETE) for key in ("format_version", "name", "observation_space", "action_space", "model")],
    (("extra",), 1), (("$schema",), 5), (("$schema",), None),
    (("format_version",), 2), (("format_version",), "1"), (("format_version",), True),
    (("name",), ""), (("name",), "  \t"), (("name",), 5), (("name",), None),
    (("seed",), -1), (("seed",), 2**31), (("seed",), 1.5), (("seed",), "0"), (("seed",), True), (("seed",), None),
    (("weights",), ""), (("weights",), 5), (("weights",), "/etc/weights.h5"), (("weights",), "../weights.h5"),
    (("weights",), "a/../../weights.h5"), (("weights",), "."), (("weights",), "./"), (("weights",), "a\\b.h5"),
    (("weights",), "a\x00b.h5"),
    # model
    (("model",), []), (("model",), None), (("model", "dropout"), 0.1),
    (("model", "hiddens"), [0]), (("model", "hiddens"), [-8]), (("model", "hiddens"), [16.5]),
    (("model", "hiddens"), "64"), (("model", "hiddens"), [True]), (("model", "hiddens"), None),
    (("model", "hiddens"), [65537]), (("model", "hiddens"), [1] * 65),
    (("model", "activation"), "sigmoid"), (("model", "activation"), None), (("model", "activation"), 1),
    (("model", "conv_filters"), "8"), (("model", "conv_filters"), None), (("model", "conv_filters"), [[8, [3, 3]]]),
    (("model", "conv_filters"), [[0, [3, 3], 1]]), (("model", "conv_filters"), [[8, [3], 1]]),
    (("model", "conv_filters"), [[8, [3, 3], 0]]), (("model", "conv_filters"), [[8, [65, 3], 1]]),
    (("model", "conv_filters"), [[8, [3, 3], 65]]), (("model", "conv_filters"), [[65537, [3, 3], 1]]),
    (("model", "conv_filters"), [[8, [3, 3], 1, 0]]), (("model", "conv_filters"), [[1, [1, 1], 1]] * 65),
    (("model", "lstm"), []), (("model", "lstm"), 16), (("model", "lstm", "cells"), 8),
    (("model", "lstm", "cell_size"), 0), (("model", "lstm", "cell_size"), 4097), (("model", "lstm", "cell_size"), "32"),
    (("model", "lstm", "max_seq_len"), 0), (("model", "lstm", "max_seq_len"), 100_001),
    (("model", "lstm", "use_prev_action"), 1), (("model", "lstm", "use_prev_reward"), "yes"),
    # any space
    (("observation_space",), []), (("observation_space", "type"), DELETE), (("observation_space", "type"), "Text"),
    (("observation_space", "type"), "Box2"), (("observation_space", "type"), 5), (("action_space",), None),
    # Box
    (CAMERA + ("low",), DELETE), (CAMERA + ("high",), DELETE), (CAMERA + ("n",), 3),
    (CAMERA + ("dtype",), "float128"), (CAMERA + ("dtype",), "bool"), (CAMERA + ("dtype",), None),
    (CAMERA + ("shape",), [0, 16, 3]), (CAMERA + ("shape",), [-16, 16, 3]), (CAMERA + ("shape",), "16"),
    (CAMERA + ("shape",), [16.5, 16, 3]), (CAMERA + ("shape",), [1] * 33),
    (CAMERA + ("low",), -1), (CAMERA + ("high",), 256), (CAMERA + ("high",), "inf"), (CAMERA + ("high",), 2.5),
    (CAMERA + ("low",), "0"), (CAMERA + ("dtype",), "int8"),  # high 255 does not fit int8
    (STATE + ("low",), "nan"), (STATE + ("low",), True), (STATE + ("low",), []), (STATE + ("low",), None),
    (STATE + ("low",), {"v": 1}),
    (PAIR + ("spaces", 1, "shape"), DELETE),  # low and high both numbers
    (PAIR + ("spaces", 1), {"type": "Box", "low": -1, "high": 65520, "shape": [2], "dtype": "float16"}),
    (PAIR + ("spaces", 1, "high"), 1e39),
    (ACT_BOX + ("high",), 3.5e38), (ACT_BOX + ("low",), -3.5e38),
    # Discrete
    (MODE + ("n",), 0), (MODE + ("n",), -1), (MODE + ("n",), 2.5), (MODE + ("n",), "3"), (MODE + ("n",), 2**20 + 1),
    (MODE + ("start",), "1"), (MODE + ("start",), 0.5), (MODE + ("start",), 2**63), (MODE + ("start",), None),
    (MODE + ("shape",), [1]),
    # MultiDiscrete
    (KEYS + ("nvec",), []), (KEYS + ("nvec",), [0]), (KEYS + ("nvec",), 3), (KEYS + ("nvec",), [2**20 + 1]),
    (KEYS + ("n",), 3),
    # MultiBinary
    (FLAGS + ("n",), 0), (FLAGS + ("n",), []), (FLAGS + ("n",), [0]), (FLAGS + ("n",), "4"),
    (FLAGS + ("n",), 2**24 + 1), (FLAGS + ("n",), [2**24 + 1]), (FLAGS + ("n",), True),
    # Dict
    (OBS, {}), (OBS, []),
    (OBS + ("bad key",), {"type": "Discrete", "n": 2}), (OBS + ("_x",), {"type": "Discrete", "n": 2}),
    (OBS + ("a",), 5), (("observation_space", "nvec"), [2]),
    # Tuple
    (PAIR + ("spaces",), []), (PAIR + ("spaces",), {}), (PAIR + ("spaces",), [5]),
    (PAIR + ("spaces", 0, "n"), DELETE), (PAIR + ("spaces", 0, "type"), "Graph"),
]


def _starts_with(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".") or path.startswith(prefix + "[")


@pytest.mark.parametrize("path, value", INVALID, ids=lambda v: repr(v)[:48])
def test_invalid_specs_are_refused_by_both(path, value):
    obj = mutate(path, value)
    near = json_path(path[:-1])  # both must complain at the changed key or its parent object
    errors = list(VALIDATOR.iter_errors(obj))
    assert errors, "the schema accepts it"
    schema_paths = [json_path(tuple(e.absolute_path)) for e in errors]
    assert any(_starts_with(p, near) for p in schema_paths), schema_paths
    with pytest.raises((SpecError, UnsupportedSpaceError)) as info:
        load(obj)
    if isinstance(info.value, SpecError):
        assert any(_starts_with(p, near) for p, _ in info.value.problems), info.value.problems


# what JSON Schema cannot say; docs/spec.md lists the same (the schema accepts, the loader refuses)
SCHEMA_CANNOT_SAY = [
    ("low > high", STATE + ("low",), [2, 0]),
    ("bounds that do not fit the shape", PAIR + ("spaces", 1, "low"), [0, 0, 0]),
    ("ragged nested bounds", STATE + ("low",), [[-1], [0, 0]]),
    ("a whole number written with a fraction", MODE + ("n",), 3.0),
    ("Dict keys that collide in tensor names", OBS + ("ca.mera",), {"type": "Discrete", "n": 2}),
    ("a weights file that does not exist", ("weights",), "no_such_file.h5"),
    ("a model over the weight limit", ("model", "hiddens"), [65536, 65536]),
    ("a space over the element limit", CAMERA + ("shape",), [4096, 4096, 3]),
]


@pytest.mark.parametrize("what, path, value", SCHEMA_CANNOT_SAY, ids=[w for w, *_ in SCHEMA_CANNOT_SAY])
def test_what_only_the_loader_checks(what, path, value):
    obj = mutate(path, value)
    if what == "Dict keys that collide in tensor names":
        obj = mutate(OBS + ("ca_mera",), {"type": "Discrete", "n": 2}, obj)
    assert not [e.message for e in VALIDATOR.iter_errors(obj)]
    with pytest.raises(SpecError):
        load(obj)
    assert what in DOCS.read_text(), f"docs/spec.md does not list {what!r}"


def test_the_schema_states_the_loaders_limits_and_keys():
    defs, model = SCHEMA["$defs"], SCHEMA["$defs"]["model"]["properties"]
    assert set(SCHEMA["required"]) == spec_mod._TOP_REQUIRED
    assert set(SCHEMA["properties"]) == spec_mod._TOP_REQUIRED | spec_mod._TOP_OPTIONAL
    assert set(model) == spec_mod._MODEL_KEYS and set(defs["lstm"]["properties"]) == spec_mod._LSTM_KEYS
    assert model["activation"]["enum"] == list(spec_mod.ACTIVATIONS)
    assert model["hiddens"]["maxItems"] == model["conv_filters"]["maxItems"] == spec_mod.MAX_LAYERS
    assert model["hiddens"]["items"]["maximum"] == spec_mod.MAX_WIDTH
    filters, kernel, stride = model["conv_filters"]["items"]["prefixItems"]
    assert filters["maximum"] == spec_mod.MAX_WIDTH
    assert kernel["items"]["maximum"] == stride["maximum"] == spec_mod.MAX_KERNEL
    lstm = defs["lstm"]["properties"]
    assert lstm["cell_size"]["maximum"] == spec_mod.MAX_LSTM_CELL
    assert lstm["max_seq_len"]["maximum"] == spec_mod.MAX_SEQ_LEN
    assert defs["space"]["properties"]["type"]["enum"] == list(spaces_mod.SPACE_TYPES)
    assert defs["Box"]["properties"]["dtype"]["enum"] == list(spaces_mod.BOX_DTYPES)
    for kind, (required, optional) in spaces_mod._FIELDS.items():
        assert set(defs[kind]["required"]) == required and set(defs[kind]["properties"]) == required | optional
    assert defs["Discrete"]["properties"]["n"]["maximum"] == spaces_mod.MAX_CATEGORIES
    assert defs["MultiDiscrete"]["properties"]["nvec"]["items"]["maximum"] == spaces_mod.MAX_CATEGORIES
    assert defs["Box"]["properties"]["shape"]["maxItems"] == spaces_mod.MAX_DEPTH
    assert defs["Box"]["properties"]["shape"]["items"]["maximum"] == spaces_mod.MAX_ELEMENTS
    assert defs["Dict"]["properties"]["spaces"]["maxProperties"] == spaces_mod.MAX_LEAVES
    assert defs["Dict"]["properties"]["spaces"]["propertyNames"]["pattern"] == f"^{spaces_mod._KEY.pattern}$"


def test_the_schema_ships_with_the_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert SCHEMA_FILE.name in config["tool"]["setuptools"]["package-data"]["policy_export.policy"]
    assert SCHEMA_FILE.parent == ROOT / "policy"
    assert "jsonschema>=4,<5" in config["project"]["optional-dependencies"]["test"]


def test_a_spec_naming_the_schema_loads(tmp_path):
    spec_dir = tmp_path / "p"
    shutil.copytree(FIXTURES_DIR / "cartpole_mlp", spec_dir)
    obj = json.loads((spec_dir / "policy.json").read_text())
    (spec_dir / "policy.json").write_text(json.dumps({"$schema": str(SCHEMA_FILE), **obj}))
    spec, ref = load_spec(spec_dir), load_spec(FIXTURES_DIR / "cartpole_mlp")
    assert (spec.name, spec.model, spec.seed) == (ref.name, ref.model, ref.seed)
    assert "$schema" not in spec.to_json()


# --------------------------------------------------------------------------- weights: names, template, refusal


def weights_table() -> str:
    """The docs table of every fixture's weights, as the loader checks them (the same as a real
    build's: tests/test_early_refusals.py compares the two on every fixture)."""
    rows = ["| spec | weight (`layer/weight`) | shape |", "|---|---|---|"]
    for name in sorted(FIXTURES):
        for i, (key, shape) in enumerate(weight_shapes(FIXTURES_DIR / name).items()):
            rows.append(f"| {f'`{name}`' if i == 0 else ''} | `{key}` | {list(shape)} |")
    return "\n".join(rows)


def test_the_docs_table_is_a_real_build_of_each_fixture():
    text = DOCS.read_text()
    begin, end = "<!-- weights table: begin -->\n", "\n<!-- weights table: end -->"
    documented = text[text.index(begin) + len(begin):text.index(end)]
    want = weights_table()
    assert documented == want, f"docs/spec.md's weights table is out of date; it should read:\n{want}"


@pytest.mark.parametrize("name", ["cartpole_lstm", "dict_image_vector"])
def test_a_template_holds_exactly_what_the_spec_needs_and_loads(name, tmp_path):
    spec_dir = tmp_path / name
    shutil.copytree(FIXTURES_DIR / name, spec_dir)
    (spec_dir / "weights.h5").unlink()  # policy.json names a file that does not exist yet
    with pytest.raises(SpecError, match="file not found"):
        load_spec(spec_dir)
    path = write_weights_template(spec_dir, spec_dir / "weights.h5", zeros=True)
    shapes = weight_shapes(FIXTURES_DIR / name)
    written = read_h5_weights(path)
    assert list(written) == list(shapes)
    assert all(v.shape == shapes[k] and not v.any() for k, v in written.items())
    with h5py.File(path, "r") as f:  # Keras's layout: /<layer>/<layer>/<weight>:0
        assert f["fc_out/fc_out/kernel:0"].shape == shapes["fc_out/kernel"]
    from policy_export.policy.tf_policy import TFPolicy

    policy = TFPolicy.from_spec(load_spec(spec_dir))
    assert all(not v.any() for v in policy.get_weights().values())
    policy.close()


def test_a_template_from_the_seed_and_no_overwrite(tmp_path):
    from policy_export import write_weights_template as exported
    from policy_export.errors import PolicyExportError

    assert exported is write_weights_template
    spec = load_spec(FIXTURES_DIR / "cartpole_mlp")
    path = write_weights_template(spec, tmp_path / "sub" / "w.h5")
    first = read_h5_weights(path)
    assert any(v.any() for v in first.values())  # the spec's initial weights, from its seed
    with pytest.raises(PolicyExportError, match="exists; pass overwrite=True"):
        write_weights_template(spec, path)
    write_weights_template(FIXTURES_DIR / "cartpole_mlp" / "policy.json", path, overwrite=True)
    again = read_h5_weights(path)
    assert all(np.array_equal(first[k], again[k]) for k in first)


def test_a_foreign_keras_h5_is_refused_with_one_hint(tmp_path):
    import tf_keras as keras

    from policy_export.policy.tf_policy import TFPolicy

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(2)])
    model.save_weights(str(tmp_path / "mine.h5"))
    policy = TFPolicy.from_spec(load_spec(FIXTURES_DIR / "cartpole_mlp"))
    with pytest.raises(WeightsError) as info:
        policy.import_model_from_h5(tmp_path / "mine.h5")
    problems = info.value.problems
    assert len(problems) == 3, problems  # missing, unexpected, the hint
    assert problems[0].startswith("6 missing weight(s), the policy's: 'fc_1/kernel' [4, 16], 'fc_1/bias' [16]")
    assert problems[1].startswith("6 unexpected weight(s)") and "'dense_2/kernel' [16, 2]" in problems[1]
    hint = problems[2]
    assert "only the names differ (dense -> fc_1, dense_1 -> fc_2, dense_2 -> fc_out)" in hint
    assert "write_weights_template" in hint and 'docs/spec.md, "Layer and weight names"' in hint
    assert "## Layer and weight names" in DOCS.read_text()
    # named like the policy's layers, the same weights load
    named = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh", name="fc_1"),
                              keras.layers.Dense(16, activation="tanh", name="fc_2"),
                              keras.layers.Dense(2, name="fc_out")])
    named.set_weights(model.get_weights())
    named.save_weights(str(tmp_path / "named.h5"))
    policy.import_model_from_h5(tmp_path / "named.h5")
    policy.close()


def test_a_few_wrong_names_keep_their_lines_and_shapes_get_no_hint(tmp_path):
    from policy_export.policy.h5io import write_h5_weights
    from policy_export.policy.tf_policy import TFPolicy

    policy = TFPolicy.from_spec(load_spec(FIXTURES_DIR / "cartpole_mlp"))
    weights = read_h5_weights(FIXTURES_DIR / "cartpole_mlp" / "weights.h5")
    weights["value_out/kernel"] = weights["fc_out/kernel"][:, :1]
    with pytest.raises(WeightsError) as info:
        policy.import_model_from_h5(write_h5_weights(tmp_path / "extra.h5", weights))
    assert info.value.problems[0].startswith("unexpected weight 'value_out/kernel'")
    assert len(info.value.problems) == 2 and info.value.problems[1].startswith("hint: ")
    weights = read_h5_weights(FIXTURES_DIR / "cartpole_mlp" / "weights.h5")
    weights["fc_1/bias"] = np.zeros(17, np.float32)
    with pytest.raises(WeightsError) as info:
        policy.import_model_from_h5(write_h5_weights(tmp_path / "shape.h5", weights))
    assert len(info.value.problems) == 1 and "hint" not in str(info.value)
    policy.close()
