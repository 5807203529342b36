"""The copy task's corpus: 4,000 files, each a random lowercase string of 40-100 letters (10-20
with --short), a newline, the same string again and a newline (the second copy is predictable
from the first).

    python make_copy_corpus.py OUT_DIR [--short]
"""
import os
import random
import string
import sys
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
r = random.Random(0)
for i in range(4000):
    s = "".join(r.choice(string.ascii_lowercase) for _ in range((r.randint(10, 20) if "--short" in sys.argv else r.randint(40, 100))))
    open(f"{out}/d{i:05d}.txt", "w").write(s + "\n" + s + "\n")
