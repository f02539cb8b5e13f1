"""A process that looks kernels up as strict serving does, and compiles them directly.

    ir_worker.py warm ROOT    (stdin: one JSON list of kernels: a case name, or an object
                              with its name, case and compile options)
    ir_worker.py serve ROOT   (stdin: one JSON request per line)

The kernels come from the test's application package ``irapp`` (``irapp.build(case)``), which
this process never imports itself: ``serve`` forks a child per request, the child applies the
request's environment, working directory and ``sys.path`` and only then imports ``irapp``, so
each case sees its change from a clean start while the DSL is imported once.

``warm`` compiles every case's kernel through the disk layer at ROOT and prints, per case, the
key it was stored under and the digest of its object (the oracle). ``serve`` answers each
request with what a strict lookup did (``hit`` and the key it loaded, or ``refused`` and the
line) and the digest of the object a direct ``cute.compile`` makes under the same change.

A kernel or request may name compile options: ``options`` (the string ``options=`` takes) and
``bracket`` (an expression for the bracket form's options, ``cute.OptLevel(1)``); with
``through: "patched"`` the request compiles through ``cute.compile`` as ``install()`` routes
it (``cute.compile[...](...)`` as an application writes it) rather than the layer's method.
"""

from __future__ import annotations

import json
import os
import site
import sys
from typing import Any

if os.environ.get("IR_SITEDIR"):  # a site directory: its .pth files run, as at start
    site.addsitedir(os.environ["IR_SITEDIR"])

import blake3
import cutlass.cute as cute

from kernelcache.errors import ColdCompileError
from kernelcache.runtime import cute as layer

ORACLE_PREFIX = "kc_oracle"  # the same symbol prefix for every object compared


def oracle(compiled: Any) -> str:
    return blake3.blake3(compiled.dump_to_object(ORACLE_PREFIX)).hexdigest()


def compile_options(request: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the bracket form's options or None, the keywords) a kernel or request names."""
    selected = eval(request["bracket"], {"cute": cute}) if request.get("bracket") else None
    return selected, ({"options": request["options"]} if request.get("options") else {})


def direct(fn: Any, args: tuple, selected: Any, kwargs: dict[str, Any]) -> Any:
    """The DSL's own ``cute.compile`` (``[selected]``), not the layer's."""
    compile_fn = layer._original_compile or cute.compile
    return (compile_fn if selected is None else compile_fn[selected])(fn, *args, **kwargs)


def warm(root: str, kernels: list[Any]) -> dict[str, Any]:
    import irapp

    cache = layer.CuteDiskCache(root)
    found = {}
    for kernel in kernels:
        kernel = kernel if isinstance(kernel, dict) else {"name": kernel, "case": kernel}
        fn, args = irapp.build(kernel["case"])
        selected, kwargs = compile_options(kernel)
        compiled = cache.compile_with(selected, fn, args, kwargs)
        key = layer.trace_with(selected, fn, args, kwargs).key
        found[kernel["name"]] = {"key": key, "oracle": oracle(compiled)}
    return {"kernels": found, "compiled": cache.stats.misses}


def serve_one(root: str, request: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(request.get("env", {}))
    for name in request.get("unset", []):
        os.environ.pop(name, None)
    if request.get("cwd"):
        os.chdir(request["cwd"])
    if request.get("path"):
        sys.path.insert(0, request["path"])
    import irapp

    fn, args = irapp.build(request["case"])
    selected, kwargs = compile_options(request)
    cache = layer.CuteDiskCache(root, strict=True)
    if request.get("through") == "patched":
        os.environ.update({layer.CACHE_DIR_ENV: root, "KERNELCACHE_STRICT": "1"})
        layer.install()
    try:
        if request.get("through") == "patched":
            (cute.compile if selected is None else cute.compile[selected])(fn, *args, **kwargs)
        else:
            cache.compile_with(selected, fn, args, kwargs)
        loaded = layer.trace_with(selected, fn, args, kwargs).key
        answer: dict[str, Any] = {"outcome": "hit", "loaded": loaded}
    except ColdCompileError as exc:
        answer = {"outcome": "refused", "message": str(exc)}
    answer["direct"] = oracle(direct(fn, args, selected, kwargs))
    return answer


def serve(root: str) -> None:
    for line in sys.stdin:
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(reader)
            try:
                answer = serve_one(root, json.loads(line))
            except BaseException as exc:  # reported, never a hung parent
                answer = {"outcome": "error", "message": f"{type(exc).__name__}: {exc}"}
            os.write(writer, json.dumps(answer).encode())
            os._exit(0)
        os.close(writer)
        with os.fdopen(reader) as pipe:
            print(pipe.read(), flush=True)
        os.waitpid(pid, 0)


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "warm":
        print(json.dumps(warm(root, json.loads(sys.stdin.read()))))
    else:
        serve(root)


if __name__ == "__main__":
    main()
