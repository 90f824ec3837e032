"""The prompts `taps bench` decodes: first turns of the evaluation benchmarks, and a small out-of-domain set.

The out-of-domain prompts (code, translation, writing, reasoning) were written for this repository: no offline
data set has translation prompts, and MT-Bench's own categories are already part of the `mt_bench` rows. They
ask for the kinds of text neither speed head was trained on (GSM8K-style math, ShareGPT chat), so they show
whether a proposer costs speed where its drafts miss.
"""

from __future__ import annotations

from collections.abc import Sequence

from taps_ray.data.sources import Question, load_questions

OOD_PREFIX = "ood-"  # a prompt's label is its benchmark, or OOD_PREFIX + its out-of-domain category

OOD_PROMPTS: dict[str, tuple[str, ...]] = {
    "code": (
        "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
        "Write a SQL query that returns the five customers with the highest total order value.",
        "Explain what this JavaScript does and fix its bug: for (var i = 0; i < 3; i++) "
        "{ setTimeout(() => console.log(i), 100); }",
        "Write a bash script that counts the lines of every .py file in a folder and prints the total.",
        "Implement binary search in C over a sorted array of ints; return -1 when the value is missing.",
        "Write a Python class for a stack with push, pop and peek, raising an error when it is empty.",
    ),
    "translation": (
        "Translate into French: The train to the airport leaves every twenty minutes from platform four.",
        "Translate into German: Please close the windows before you leave the office tonight.",
        "Translate into Spanish: My grandmother grows tomatoes, peppers and beans in her small garden.",
        "Translate into English: Je voudrais réserver une table pour deux personnes à huit heures.",
        "Translate into Italian: The museum is closed on Mondays, but the park is open every day.",
        "Translate into English: Wir haben gestern den ganzen Nachmittag im Regen auf den Bus gewartet.",
    ),
    "writing": (
        "Write a short poem about the first snow of winter in a quiet town.",
        "Write a friendly email inviting the neighbours to a street party next Saturday.",
        "Write the opening paragraph of a mystery story set on a night ferry.",
        "Write a product description for a reusable water bottle that keeps drinks cold for a day.",
        "Write a thank-you note to a teacher who helped you prepare for an exam.",
        "Write a short speech welcoming new volunteers to a community library.",
    ),
    "reasoning": (
        "All roses are flowers and some flowers fade quickly. Can we conclude that some roses fade quickly? Explain.",
        "If it takes five machines five minutes to make five widgets, how long do 100 machines take for 100 widgets?",
        "Anna is older than Ben, and Ben is older than Carl. Who is the youngest, and why?",
        "A bat and a ball cost 1.10 dollars in total; the bat costs one dollar more than the ball. "
        "What does the ball cost?",
        "Which is the odd one out: apple, banana, carrot, cherry? Explain your choice.",
        "A clock shows 3:15. What is the angle between the hour and the minute hands?",
    ),
}


def spread(questions: Sequence[Question], n: int) -> list[Question]:
    """`n` questions taken evenly through the set, so a set stored by category (MT-Bench) contributes every
    category rather than its first one or two."""
    if n >= len(questions):
        return list(questions)
    return [questions[i * len(questions) // n] for i in range(n)]


def first_turns(benchmarks: Sequence[str], per_benchmark: int, categories: Sequence[str], per_category: int,
                data_dir: str | None) -> list[tuple[str, str]]:
    """(label, first user turn) for every bench prompt, benchmarks first, then out-of-domain categories."""
    prompts = [(b, q.turns[0]) for b in benchmarks for q in spread(load_questions(b, data_dir), per_benchmark)]
    for category in categories:
        if category not in OOD_PROMPTS:
            raise ValueError(f"unknown out-of-domain category {category!r}; choose from {', '.join(OOD_PROMPTS)}")
        prompts += [(OOD_PREFIX + category, text) for text in OOD_PROMPTS[category][:per_category]]
    return prompts
