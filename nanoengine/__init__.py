"""nanoengine: vLLM's V1 engine, rebuilt small enough to read, real enough to run.

Start at ``LLM`` (entrypoints/llm.py, chapter 1) and follow the component tree
that ``print(llm)`` shows (chapter 5); each module's docstring names the chapter
that explains it and the vLLM 0.32 file it mirrors.
"""

from nanoengine.entrypoints.llm import LLM
from nanoengine.inputs import PromptType, TextPrompt, TokensPrompt
from nanoengine.outputs import CompletionOutput, RequestOutput
from nanoengine.sampling_params import RepetitionDetectionParams, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "PromptType",
    "RepetitionDetectionParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]
__version__ = "0.1.0"
