"""A process that looks kernels up as strict serving does, and compiles them directly.

    ir_worker.py warm ROOT    (stdin: one JSON list of case names)
    ir_worker.py serve ROOT   (stdin: one JSON request per line)

The kernels come from the test's application package ``irapp`` (``irapp.build(case)``), which
this process never imports itself: ``serve`` forks a child per request, the child applies the
request's environment, working directory and ``sys.path`` and only then imports ``irapp``, so
each case sees its change from a clean start while the DSL is imported once.

``warm`` compiles every case's kernel through the disk layer at ROOT and prints, per case, the
key it was stored under and the digest of its object (the oracle). ``serve`` answers each
request with what a strict lookup did (``hit`` and the key it loaded, or ``refused`` and the
line) and the digest of the object a direct ``cute.compile`` makes under the same change.
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


def warm(root: str, cases: list[str]) -> dict[str, Any]:
    import irapp

    cache = layer.CuteDiskCache(root)
    found = {}
    for case in cases:
        fn, args = irapp.build(case)
        compiled = cache.compile(fn, *args)
        found[case] = {"key": layer.trace(fn, *args).key, "oracle": oracle(compiled)}
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
    cache = layer.CuteDiskCache(root, strict=True)
    try:
        cache.compile(fn, *args)
        answer: dict[str, Any] = {"outcome": "hit", "loaded": layer.trace(fn, *args).key}
    except ColdCompileError as exc:
        answer = {"outcome": "refused", "message": str(exc)}
    answer["direct"] = oracle(cute.compile(fn, *args))
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
