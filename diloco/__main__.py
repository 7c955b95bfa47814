import gc
import sys

from diloco.cli import main

code = main()
# The process ends here. Its last garbage collection would walk every object torch's import made
# (seconds of CPU for each worker, agent and coordinator, on every exit and restart): skip it; the
# exit frees the memory, and what main() had to close, flush or save it has.
gc.freeze()
sys.exit(code)
