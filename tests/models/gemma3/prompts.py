"""Prompts of the Gemma 3 fidelity tests and benchmark: varied text, code, numbers, non-Latin
scripts, chat turns, and one prompt longer than the 512-token sliding window."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "Translate to German: The weather is nice today.\nGerman:",
    "1, 1, 2, 3, 5, 8, 13,",
    "Les plus beaux endroits de Paris sont",
    "<start_of_turn>user\nWhat is the boiling point of water?<end_of_turn>\n<start_of_turn>model\n",
    "Q: What is 12 times 12?\nA:",
    "日本の首都は",
]


def long_prompt() -> str:
    """~700 tokens: a numbered log that the model continues (longer than the 512-token window)."""
    lines = [f"Day {i}: the lighthouse keeper wrote that the wind came from the {d} and {n} ships passed."
             for i, (d, n) in enumerate(zip(["north", "east", "south", "west"] * 8, range(3, 35)), start=1)]
    return "Logbook of the old lighthouse.\n" + "\n".join(lines) + "\nDay 33: the lighthouse keeper wrote that"
