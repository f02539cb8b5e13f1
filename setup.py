"""Ships ``zz_kernelcache_runtime.pth`` at the top of purelib, beside the ``kernelcache`` package.

``site`` runs the lines of ``.pth`` files found directly in site-packages at interpreter
start; that is how the runtime hooks a serving engine with no code change
(``KERNELCACHE_RUNTIME=1``). Package data can only land inside a package, so ``build_py``
copies the file into the build's top level, which a wheel installs into purelib as is.

Its name sorts after every other ``.pth`` file's: ``site`` runs them in name order, and the
hook checks the generation's stamp against this interpreter's modules, which later ``.pth``
files still add to ``sys.path`` (nvidia-cutlass-dsl's puts the DSL's packages there). Run
before them, the hook finds ``cutlass`` missing and refuses a generation that is fine.
Everything else is in ``pyproject.toml``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = "zz_kernelcache_runtime.pth"


class build_py_with_hook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path("src") / HOOK), str(Path(self.build_lib) / HOOK))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / HOOK)]


setup(cmdclass={"build_py": build_py_with_hook})
