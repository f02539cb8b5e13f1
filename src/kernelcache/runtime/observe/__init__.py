"""What a compile actually read, and what of it has moved since: the explanation of a miss.

A CuTe-DSL kernel is keyed by its traced IR (``kernelcache.runtime.cute``): that decides
whether it loads. This record says why a kernel's IR may differ in another process, by
mechanism rather than by name, where it can see it:

- a Python audit hook sees every ``open`` (``exec(open(...).read())``, ``pkgutil.get_data``,
  ``runpy``, a JSON read at import), and every subprocess and socket (what those read cannot
  be seen: noted in the record; not ``ctypes.util.find_library``'s ``ldconfig``, which names
  a library the process then maps); a finder last on ``sys.meta_path`` sees every import
  nothing could satisfy (an optional helper: ``absent``, so that it appearing is a change);
- ``sys.modules`` at the compile names every module loaded, whatever loaded it (a
  ``spec_from_file_location``, a zip archive, a ``.pyc`` without source, a ``.pth`` hook);
- ``/proc/self/maps`` names every shared library mapped since observation began;
- ``os.environ`` reads are seen by name and caller: the ones code outside the Python
  installation and the installed distributions makes, and a toolchain's compile settings.

Each file is recorded by where it resolves (a module by its name, a file relative to the
``sys.path`` entry or working directory it was found under, else its absolute path: no host
path becomes a factor) and by its identity: the digest of a project file's bytes; for a file of
an installed distribution its RECORD hash and the distribution's version and RECORD digest;
for the standard library its digest. ``Checker`` resolves each again in this process, on a
strict miss or for ``kernelcache explain``: a different digest, a module resolving elsewhere
(a local ``profile.py`` shadowing the standard library), a distribution upgraded, a variable
changed is named.

Not recorded, because they cannot change the compiled code: the generation's own files (the
compile's outputs), ``/proc``, ``/sys`` and ``/dev``, bytecode caches beside their source (Python
checks them against it), files the process wrote itself, and kernelcache's own modules (what it
passes to the compile is in the key, whose format is versioned).
"""

from kernelcache.runtime.observe.check import Checker
from kernelcache.runtime.observe.hooks import start, unobserved_block
from kernelcache.runtime.observe.identity import file_digest
from kernelcache.runtime.observe.record import FORMAT, digest, record

__all__ = ["FORMAT", "Checker", "digest", "file_digest", "record", "start", "unobserved_block"]
