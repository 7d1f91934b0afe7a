import os
import sys

# Rank processes are spawned: they import worker functions from this folder by module name.
sys.path.insert(0, os.path.dirname(__file__))
