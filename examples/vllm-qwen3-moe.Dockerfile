# The serving image of examples/vllm-qwen3-moe.yaml: vLLM 0.26.0, the model's weights, and
# kernelcache's runtime with its start-up hook. The compile Job runs `kernelcache warm` in this
# very image, so the vLLM install path, the model path and every distribution the stamp
# records are the ones serving will have.
#
#   docker build -f examples/vllm-qwen3-moe.Dockerfile -t registry.example.com/vllm-kc:0.26.0 .
FROM vllm/vllm-openai:v0.26.0

COPY pyproject.toml setup.py README.md /tmp/kernelcache/
COPY src /tmp/kernelcache/src
# The .pth hook runs kernelcache.runtime.autoinstall() at every interpreter start when
# KERNELCACHE_RUNTIME=1 (the webhook sets it): vLLM's engine-core process gets it too.
RUN pip install --no-cache-dir --disable-pip-version-check "/tmp/kernelcache[runtime]" \
    && rm -rf /tmp/kernelcache

# The weights at the path the KernelCache declares (workload.model): vLLM's cache names it.
COPY models/Qwen3-30B-A3B /models/Qwen3-30B-A3B

ENTRYPOINT ["vllm", "serve"]
