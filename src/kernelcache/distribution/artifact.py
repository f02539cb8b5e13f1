"""The artifact's shape: an OCI image manifest with a real image config and tar layers that
hold the generation's own files, so that containerd and CRI-O (which mount only image-shaped
manifests) can mount it as an image volume: the volume's root is the generation directory.

Layers, in order: MANIFEST.json with its signature (small: a puller checks it before it
fetches anything else), then one layer per subtree of files/ (``files/<toolchain>``), each a
deterministic tar (sorted, owner 0, mtime 0, modes as the store sets them), so that the same
subtree always makes the same blob. Each layer names its subtree in an annotation; the
manifest carries the key, the generation id and the stamp digest (names in ``contract``).
"""
