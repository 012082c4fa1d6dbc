"""nanotron: minimal 3D-parallel (dp x tp x pp) Llama pretraining on DeviceMesh/DTensor."""

import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# Module spellings of commands that now live in nanotron.commands: `python -m <old>` answers with the new one.
RETIRED_SPELLINGS = {
    "nanotron.cli": "COMMAND",
    "nanotron.convert": "convert",
    "nanotron.coord_check.__main__": "coord-check",
    "nanotron.doctor": "doctor",
    "nanotron.evaluate": "eval",
    "nanotron.generate": "generate",
    "nanotron.launch.local": "torchrun",
    "nanotron.plan.__main__": "plan",
    "nanotron.prepare": "prepare",
    "nanotron.report": "report",
    "nanotron.tokenize.__main__": "tokenize",
}


class _RetiredSpelling(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on the import path: only a module that no longer exists reaches it."""

    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name in RETIRED_SPELLINGS else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):  # `import nanotron.doctor`
        exec(self.get_code(module.__name__), vars(module))

    def get_code(self, name):  # `python -m nanotron.doctor` (runpy runs the code in __main__)
        old, new = name.removesuffix(".__main__"), RETIRED_SPELLINGS[name]
        line = f"error: `python -m {old}` is now `nanotron {new}` (or `python -m nanotron {new}`)"
        return compile(f"import sys\nprint({line!r}, file=sys.stderr)\nraise SystemExit(2)\n", name, "exec")


sys.meta_path.append(_RetiredSpelling())
