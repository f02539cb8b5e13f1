"""The registry client: a thin layer over oras-py's ``Registry``, which speaks the
distribution API (auth challenges, tokens, upload sessions, TLS with a CA bundle).

What this layer adds and why: manifests are sent and read as bytes (oras-py re-serializes a
dict, and a manifest's digest is that of its exact bytes); requests are not retried with
oras-py's backoff (minutes before an unreachable registry is reported); credentials are
sent from the first request (a basic-auth registry would otherwise see every body twice);
every failure becomes one line of its exit class.
"""
