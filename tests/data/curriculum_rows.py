"""Rows and a reward for the curriculum tests: half the prompts are solved by every sample."""


def rows(n=16):
    """``n`` prompts; even ones are easy (every sample passes), odd ones hard (answer 'hard')."""
    return [{"prompt": f"question {i}", "answer": "easy" if i % 2 == 0 else "hard"} for i in range(n)]


def easy_or_parity(completion, answer, **kwargs):
    """1 for an easy prompt's every sample; for a hard one 1 or 0 by the parity of the completion's length,
    so its samples disagree and its pass rate sits near 0.5."""
    return 1.0 if answer == "easy" else float(len(completion) % 2)
