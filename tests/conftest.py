import sys
from pathlib import Path

# The end-to-end tests drive the same local launcher as the README demo (scripts/local_cluster.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
