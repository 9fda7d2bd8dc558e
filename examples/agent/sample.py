"""The demo's task: questions about a tiny sample project (`sample_project/`), each answered by
a short fact in one short file.

SmolLM2-135M, the model `make demo` serves, cannot answer questions about a real repository's
docs (it read the same long file over and over and gave one truncated answer to everything),
but it can find a short file, read it and copy a fact from it. The facts are ones it cannot
guess (a port number, a name), so an answer that holds one came from the file it read.
"""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "sample_project"

# Each question, and the fact its answer must hold (tests/integration/test_examples.py checks
# SmolLM2's answers for them).
FACTS = {
    "Which port does the notebox server listen on?": "8421",  # config.toml
    "Who maintains notebox?": "Maria Lopez",  # README.md
    "Which license is notebox released under?": "Apache",  # LICENSE.md
}
QUESTIONS = list(FACTS)
