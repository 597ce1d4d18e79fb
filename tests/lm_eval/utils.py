"""process_docs for the local lm-eval tasks in this directory (passed to lm-eval with
--include_path tests/lm_eval)."""


def _final_answer(solution):
    # GSM8K solutions end in "#### <number>".
    return solution.split("####")[-1].strip()


def process_docs_mc(dataset):
    """Four choices per question: the right final answer and the answers of the
    next problems (in file order) that differ from it; the right one sits at
    position index % 4, so the gold position is spread evenly and deterministic."""
    answers = [_final_answer(a) for a in dataset["answer"]]
    count = len(answers)

    def add_choices(doc, index):
        correct = answers[index]
        distractors = []
        other = index
        while len(distractors) < 3:
            other = (other + 1) % count
            candidate = answers[other]
            if candidate != correct and candidate not in distractors:
                distractors.append(candidate)
        gold = index % 4
        choices = distractors[:gold] + [correct] + distractors[gold:]
        return {"choices": choices, "gold": gold}

    return dataset.map(add_choices, with_indices=True)
