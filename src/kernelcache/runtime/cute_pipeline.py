"""What the DSL's compiler will receive after a trace, as part of a CuTe-DSL kernel's key.

The traced IR is the compiler's input (``kernelcache.runtime.cute``); this module keys the
rest of the compile as it will run:

- **the options the compiler receives**: the pass pipeline the DSL builds for this one call
  (``_get_pipeline`` then ``preprocess_pipeline``, exactly as its compile backend does), parsed
  into pass options and normalised: a quoted value is its text, a bare flag is ``true``, an
  option given twice with one value is given once, their order is not kept (a raw
  ``CUTE_DSL_COMPILER_OPT`` token that the DSL appends to its shared options on every call is
  one option however many calls came before), a default spelled out is the default and
  ``--gpu-arch`` naming the arch already targeted is the same pipeline. Options proven by a
  compile both ways to leave the object as it is (``NOT_CODE``) are left out; every other
  one, ``flatten-locs-output-json-path`` too (it runs a pass), is in the key, a path by its
  tail. Options that are no pipeline option but shape the exported object (the host target,
  the TVM-FFI calling convention) are keyed beside it.
- **the DSL settings**: its own compile-affecting ``CUTE_DSL_*`` list, less the ones that
  reach the compile only as options already keyed above (a setting spelled two ways that
  makes one pipeline is one key).
- **the pipeline itself**: the functions the DSL calls after the trace (its compile backend,
  ``Compiler.compile``, the pipeline builders, a post-compile hook) must be the DSL's own. A
  patched or wrapped one can rewrite the pipeline in any way and read anything; its effect
  cannot be keyed, so the call is not cached and strict mode refuses it, naming the function
  and where it was defined (``replaced_pipeline``).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

# Pipeline options that only report on the compile, never change its object: each is proven
# so by a test that compiles with and without it and compares the objects
# (tests/test_key_ir.py): ``diagnostic`` (``warnings{…}``/``remarks{…}``: the checker's
# collection passes) and the dump paths of ``CUTE_DSL_KEEP_PTX``/``_KEEP_CUBIN``.
NOT_CODE = frozenset({"diagnostic", "dump-ptx-path", "dump-cubin-path"})

# Settings the DSL applies only through the compile options (``apply_envar_settings``): their
# effect is the pipeline (and the export options) keyed beside them.
IN_OPTIONS = frozenset({"compiler_opt", "lineinfo", "enable_assertions", "enable_tvm_ffi"})

# The DSL object's methods that run after the trace-finalize hooks, through to the compiler.
_AFTER_TRACE = (
    "compile_and_cache",
    "build_module",
    "_merge_gpu_link_libraries",
    "_get_pipeline",
    "_get_extension_pipeline",
    "preprocess_pipeline",
    "get_shared_libs",
    "_compile_or_jit_module",
    "compile_and_jit",
    "_build_jit_function",
)
_COMPILER = ("compile", "compile_and_jit", "jit")
_BACKEND = ("compile", "_resolve_compile_cache", "_build_compiled_function")
_OPTIONS = ("to_str", "_finalize_derived_options")


def unpathed(value: str) -> str:
    """Keep the tail of a path (``cu12/lib/libx.so``: the variant) and drop the install prefix.

    Each path of a list (``a.so:b.so``, as ``CUTE_DSL_LIBS`` takes) keeps its own tail.
    """
    return re.sub(r"'?/[^;':]*/([^/;':]+/[^/;':]+/[^/;':]+)'?", r"\1", value)


def pipeline_of(owner: Any, pipeline: str | None = None) -> str:
    """The pass pipeline the DSL (``owner``) will hand its compiler for the call being traced:
    the options this call received (``pipeline``: one the caller passed), built as the
    compile backend builds them, for the arch it resolves."""
    arch = owner.compile_options.gpu_arch or owner.envar.arch or ""
    return str(owner.preprocess_pipeline(owner._get_pipeline(pipeline), arch))


def normalised(pipeline: str) -> dict[str, Any]:
    """``{pass: {option: value}}`` of a pipeline string, in canonical form: quotes and
    repeats gone, bare flags ``true``, options sorted, paths by their tail, ``NOT_CODE`` out.

    An option given more than once with different values keeps them all, in order (which
    one the pass takes is the compiler's business: two orders are two keys)."""
    passes: dict[str, Any] = {}
    for name, body in _passes(pipeline):
        options: dict[str, list[str]] = {}
        for token in _tokens(body):
            key, sep, value = token.partition("=")
            if key in NOT_CODE:
                continue
            values = options.setdefault(key, [])
            shown = _value(key, value if sep else "true")
            if shown in values:
                values.remove(shown)
            values.append(shown)
        passes[name] = {
            key: values[0] if len(values) == 1 else values
            for key, values in sorted(options.items())
        }
    return passes


def export_options(owner: Any) -> dict[str, Any]:
    """Options that are no pipeline option but shape the exported object."""
    options = owner.compile_options
    host = getattr(options, "host_target", None)
    return {
        "host-target": str(getattr(host, "value", "") or ""),
        "tvm-ffi": bool(getattr(options, "enable_tvm_ffi", False)),
    }


def settings(envar: Any) -> str:
    """The DSL's compile-affecting settings (the list it keys its own cache on), less those
    that reach the compile only as keyed options; paths by their tail."""
    spec = getattr(type(envar), "_ENV_VAR_SPEC", None)
    if spec is None:  # another DSL layout: all of them, as the DSL renders them
        return unpathed(envar.cache_key_str())
    rendered = []
    for entry in sorted(spec, key=lambda e: e.key_name):
        if not entry.affects_compile or entry.key_name in IN_OPTIONS:
            continue
        value = getattr(envar, entry.key_name)
        if value is None:
            continue
        if isinstance(value, (set, frozenset)):
            value = tuple(sorted(value, key=repr))
        rendered.append(f"{entry.key_name}={value!r};")
    return unpathed("".join(rendered))


def replaced_pipeline(owner: Any) -> str | None:
    """The first function the DSL calls after the trace that is not the DSL's own (patched,
    wrapped or set as a hook), named with where it was defined; None when all are its own."""
    from cutlass.base_dsl import compile_backend, compiler, dsl

    compiler_object = owner.compiler_provider
    hook = getattr(compiler_object, "_post_compile_hook", None)
    found: list[tuple[str, Any]] = [
        *((f"{type(owner).__name__}.{n}", getattr(owner, n, None)) for n in _AFTER_TRACE),
        *((f"Compiler.{n}", getattr(compiler_object, n, None)) for n in _COMPILER),
        ("get_compiler_backend", getattr(dsl, "get_compiler_backend", None)),
        *(
            (f"{compile_backend.LegacyCompilerBackend.__name__}.{n}", getattr(backend, n, None))
            for backend in [compile_backend.LegacyCompilerBackend]
            for n in _BACKEND
        ),
        *((f"CompileOptions.{n}", getattr(compiler.CompileOptions, n, None)) for n in _OPTIONS),
        *([("the compiler's post-compile hook", hook)] if hook is not None else []),
    ]
    for name, function in found:
        if function is not None and not _dsl_own(function):
            return f"{name} is {_where(function)}, not the DSL's own"
    return None


def _dsl_own(function: Any) -> bool:
    target = getattr(function, "__func__", function)
    if hasattr(target, "__wrapped__"):
        return False  # a wrapper made with functools.wraps, whatever file it is in
    code = getattr(target, "__code__", None)
    if code is None:  # a C function: the DSL's when its module is
        module = getattr(target, "__module__", None) or ""
        return module.startswith(("cutlass", "_mlir", "builtins"))
    return _in_dsl(code.co_filename)


@cache
def _in_dsl(filename: str) -> bool:
    """Whether a code file is the DSL's (under the folders its packages are in, links
    resolved on both sides: an install reached through a link is the same install)."""
    return os.path.realpath(filename).startswith(_dsl_roots())


@cache
def _dsl_roots() -> tuple[str, ...]:
    """The folders the DSL's Python code is in (those its distributions install)."""
    import cutlass

    return tuple(os.path.realpath(Path(p).parent) + os.sep for p in cutlass.__path__)


def _where(function: Any) -> str:
    target = getattr(function, "__func__", function)
    name = f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"
    code = getattr(target, "__code__", None)
    return f"{name} ({Path(code.co_filename).name})" if code is not None else name


def _passes(pipeline: str) -> Iterator[tuple[str, str]]:
    """``(pass, its option text)`` for each pass of ``builtin.module(a{…}, b{…})``."""
    inner = pipeline.strip()
    match = re.fullmatch(r"builtin\.module\((.*)\)", inner, re.DOTALL)
    if match is not None:
        inner = match[1]
    for found in _PASS.finditer(inner):
        if found[1]:
            yield found[1], found[2] or ""


_PASS = re.compile(r"\s*([\w.-]+)\s*(?:\{((?:[^{}'\"]|'[^']*'|\"[^\"]*\")*)\})?\s*,?")


def _tokens(body: str) -> list[str]:
    try:
        return shlex.split(body)
    except ValueError:  # unbalanced quotes: the text as it is, one token per word
        return body.split()


def _value(key: str, value: str) -> str:
    if key == "ptx-options":  # ptxas flags: repeats dropped, the order of their last kept
        return " ".join(reversed(dict.fromkeys(reversed(_tokens(value)))))
    return unpathed(value) if "/" in value else value
