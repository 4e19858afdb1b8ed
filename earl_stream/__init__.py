"""earl_stream: asynchronous streaming agentic RL for LLMs with a layout-indexed experience store.

The public environment API lives here: `StepResult` and the `Environment` protocol.
"""

from earl_stream.env import Environment, StepResult

__all__ = ["Environment", "StepResult", "__version__"]
__version__ = "0.3.0"
