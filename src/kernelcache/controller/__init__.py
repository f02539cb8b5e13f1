"""The KernelCache operator: compile Jobs per SM arch, status from their results, cleanup.

``main`` is the only module that knows kopf; it registers thin handlers that call into
``handlers/``, which take plain arguments and call the pure builders of ``manifests`` and the
pure decisions of ``state``. Run it with ``kernelcache operator`` or
``kopf run -m kernelcache.controller.main``.
"""
