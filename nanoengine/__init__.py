"""nanoengine: vLLM's V1 engine, rebuilt small enough to read, real enough to run.

Start at ``LLM`` (entrypoints/llm.py) and follow the component tree that
``print(llm)`` shows; each module's docstring names the chapter that explains
it and the vLLM 0.32 file it mirrors.
"""

from nanoengine.entrypoints.llm import LLM
from nanoengine.outputs import CompletionOutput, RequestOutput
from nanoengine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
