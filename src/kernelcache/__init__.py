"""kernelcache: compile GPU kernels ahead of time, store them stamped, verify before serving."""

__version__ = "0.1.0"
