"""The demo workload: a small GPT (``model``), a byte-level corpus read offline (``data``), and the
task that trains one on the other (``task.gpt_task``, what ``diloco run`` trains by default).
"""

from diloco.demo.task import gpt_task

__all__ = ["gpt_task"]
