"""Trillium: an LLM inference server (trio actors over ZeroMQ, paged KV cache).

Offline use:

    from trillium import LLM, SamplingParams
    llm = LLM(model="path/to/hf-dir-or.gguf")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)
"""

from trillium.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # WHY: lazy, so `import trillium` (e.g. for SamplingParams or the CLI's
    # --help) does not import torch.
    if name == "LLM":
        from trillium.llm import LLM

        return LLM
    if name == "LoRARequest":
        from trillium.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(name)
