"""Which third-party modules vLLM imports when its OpenAI server starts and serves a Llama/Qwen2
model: a static walk of the import graph from a few entry modules, read from the unzipped wheel
(vLLM is never imported or installed here).

    python bench/peer/import_scan.py SRC_DIR [ROOT_MODULE ...]   # prints JSON

Followed: module-level imports (also in module-level `if`/`else`, `with` and `try` bodies) and the
package `__init__`s on the way. Not followed: imports inside functions or classes' methods
(lazy: features the benchmark does not use), under `if TYPE_CHECKING:`, and those in a `try:`
whose handler catches ImportError/ModuleNotFoundError/Exception (optional by construction).
The result is what the import of the roots needs; lazy imports that run at start-up are added
by hand in prepare.sh (EXTRA), from reading the start-up path.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

# vLLM's start-up as the benchmark uses it: the server, the engine core process, the GPU worker,
# the two model families, the attention backend vLLM picks on Hopper (FLASH_ATTN), the sampler,
# the tokenizer and the generative scoring endpoint. check_vllm.py imports these (and the app's
# routers) on the device; the scan below starts from them.
START_UP_MODULES = (
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.sample.sampler",
    "vllm.entrypoints.generate.generative_scoring.serving",
    "vllm.entrypoints.generate.api_router",
    "vllm.compilation.backends",
    "vllm.tokenizers.hf",
)
# The scan also walks the CLI entry and the CUDA platform (check_vllm.py imports the latter only
# where a GPU is present).
ROOTS = (*START_UP_MODULES, "vllm.entrypoints.cli.main", "vllm.platforms.cuda")
OPTIONAL_EXC = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _catches_import_error(node: ast.Try) -> bool:
    for h in node.handlers:
        if h.type is None:
            return True
        types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        for t in types:
            name = t.id if isinstance(t, ast.Name) else getattr(t, "attr", "")
            if name in OPTIONAL_EXC:
                return True
    return False


def module_imports(tree: ast.Module, modname: str, is_pkg: bool) -> list[str]:
    """Absolute names imported at module level (`from a import b` gives a and a.b)."""
    out: list[str] = []
    package = modname if is_pkg else modname.rpartition(".")[0]

    def visit(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, ast.Import):
                out.extend(a.name for a in s.names)
            elif isinstance(s, ast.ImportFrom):
                if s.level:
                    base = package.split(".")
                    base = base[: len(base) - (s.level - 1)]
                    mod = ".".join(base + ([s.module] if s.module else []))
                else:
                    mod = s.module or ""
                out.append(mod)
                out.extend(f"{mod}.{a.name}" for a in s.names if a.name != "*")
            elif isinstance(s, ast.If):
                if _is_type_checking(s.test):
                    visit(s.orelse)
                else:
                    visit(s.body)
                    visit(s.orelse)
            elif isinstance(s, ast.Try):
                if not _catches_import_error(s):
                    visit(s.body)
                visit(s.finalbody)
            elif isinstance(s, ast.With):
                visit(s.body)

    visit(tree.body)
    return out


def scan(src: Path, roots: tuple[str, ...] = ROOTS) -> dict[str, list[str]]:
    """{third-party top-level module: [vllm modules importing it at module level]}."""
    seen: set[str] = set()
    third: dict[str, set[str]] = {}
    stdlib = set(sys.stdlib_module_names)
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        path = src.joinpath(*parts)
        if (path / "__init__.py").is_file():
            file, is_pkg = path / "__init__.py", True
        elif path.with_suffix(".py").is_file():
            file, is_pkg = path.with_suffix(".py"), False
        else:
            continue  # an attribute (from m import f), a compiled module, or data
        for i in range(1, len(parts)):  # parent packages run first
            todo.append(".".join(parts[:i]))
        tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
        for imp in module_imports(tree, name, is_pkg):
            top = imp.split(".")[0]
            if top == "vllm":
                todo.append(imp)
            elif top and top not in stdlib and not top.startswith("_"):
                third.setdefault(top, set()).add(name)
    return {k: sorted(v) for k, v in sorted(third.items())}


def main(argv: list[str]) -> int:
    src = Path(argv[0])
    roots = tuple(argv[1:]) or ROOTS
    print(json.dumps(scan(src, roots), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
