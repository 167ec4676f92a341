"""Varied prompts for the losslessness tests: code, prose, lists, JSON, copying, chat."""

from __future__ import annotations

CODE = [
    "def fibonacci(n):\n    ",
    'import numpy as np\n\ndef normalize(v):\n    """Scale v to unit length."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "// C function that reverses a string in place\nvoid reverse(char *s) {\n",
    "SELECT name, COUNT(*) FROM orders\n",
    "#!/bin/bash\n# back up the home directory\n",
]
PROSE = [
    "The history of the Roman Empire",
    "Once upon a time, there was a little girl who",
    "The most important lesson I learned in school was",
    "Photosynthesis is the process by which",
    "In the year 2050, cities will",
    "The old lighthouse keeper looked out at the sea and",
]
LISTS = [
    "Ingredients for pancakes:\n1.",
    "Top five tips for better sleep:\n-",
    "Steps to change a flat tire:\n1.",
    "Planets of the solar system, in order:\n1.",
]
JSON = [
    '{"name": "Alice", "age": 30, "city":',
    'A JSON object describing a book:\n{"title":',
    '[{"id": 1, "status": "open"}, {"id": 2, "status":',
    'Config:\n{"server": {"host": "localhost", "port":',
]
COPYING = [
    "Repeat after me: the quick brown fox jumps over the lazy dog.\nRepeated: the quick",
    "Text: Paris is the capital of France. Berlin is the capital of Germany.\n"
    "Question: What is the capital of Germany?\nAnswer:",
    "Summarize: The meeting was moved from Monday to Thursday because the CEO was travelling.\n"
    "Summary:",
    "Fix the typo: 'The wether is nice today.'\nCorrected:",
    "Translate to French: Good morning, how are you?\nFrench:",
    "Q: What is 12 times 12?\nA:",
]
CHAT = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Explain recursion in one sentence.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nGive me three names for a cat.<|im_end|>\n<|im_start|>assistant\n",
]

ALL = CODE + PROSE + LISTS + JSON + COPYING + CHAT
