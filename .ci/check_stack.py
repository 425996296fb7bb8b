"""Fail when the environment does not hold the given versions: `python .ci/check_stack.py tensorflow==2.15.1 numpy<2`."""

import sys
from importlib.metadata import version

from packaging.requirements import Requirement


def main(argv: list[str]) -> int:
    bad = []
    for text in argv:
        req = Requirement(text)
        have = version(req.name)
        if have not in req.specifier:
            bad.append(f"{req.name} {have} (wanted {req.specifier})")
    for name in ("tensorflow", "tf-keras", "numpy", "onnx", "onnxruntime", "ray", "gymnasium"):
        print(f"{name} {version(name)}")
    if bad:
        print("the install moved RLlib's stack: " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
