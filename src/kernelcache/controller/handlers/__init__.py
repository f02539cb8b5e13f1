"""What the operator does for each event, in plain functions: no kopf, only arguments.

Each module handles one verb on one resource and is called from one registration in
``kernelcache.controller.main``; they reach the API server through ``Kube`` and leave every
decision to ``manifests`` (what to create) and ``state`` (what the observed state means).
"""
