"""`--workload grounded`: input-grounded prompts, where much of the answer is in the prompt
(repeating or editing a passage, answering from it, rewriting code): the work prompt-lookup
speculative decoding is for (`bench latency --workload grounded --each-prompt`)."""

from __future__ import annotations

_PASSAGE = (
    "The lighthouse on Gull Point was built in 1871 from granite quarried on the island itself. Its lamp "
    "burned whale oil until 1885, then kerosene, and finally electricity after a cable reached the point in "
    "1932. The last keeper, Margaret Ellis, left in 1968, when the light was automated. Today the tower is a "
    "museum, open from May to October, and its lens, a second-order Fresnel lens made in Paris, still turns "
    "every night. Visitors climb one hundred and twelve steps to reach the gallery, where on a clear day they "
    "can see three other lighthouses along the coast. The keeper's cottage at the foot of the tower holds the "
    "logbooks, which record every ship that passed between 1871 and 1968, the weather of each day, and the "
    "great storm of 1913, when waves broke over the gallery and the keeper kept the lamp burning for four "
    "nights without sleep.")

_TYPOS = (
    "Our team meet every monday at nine to plan the week. We reveiw open tickets, asign owners, and agree on "
    "what must ship by friday. Anyone who can not attend should post there update in the channel before the "
    "meeting, so that nobody have to wait for informations. After the meeting, the notes is shared with the "
    "hole team and with the support desk, who needs to know which fixes is coming. If a ticket are blocked, "
    "its owner explain why and ask for help, rather then waiting untill the next week. We try to keep the "
    "meeting under thirty minutes, becuase long meetings leaves less time for the work itself.")

_CODE = '''def summarize(orders):
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["quantity"] * order["price"]
        if customer not in totals:
            totals[customer] = 0
        totals[customer] += amount
    best = None
    for customer, total in totals.items():
        if best is None or total > totals[best]:
            best = customer
    return totals, best'''

_CSV = ("name,role,city\nAda Park,engineer,Lisbon\nBen Ortiz,designer,Oslo\nChen Wu,manager,Austin\n"
        "Dana Roy,analyst,Nairobi\nEli Stone,engineer,Kyoto")

TASKS = [
    f"Repeat the following paragraph exactly, word for word:\n\n{_PASSAGE}",
    "Fix the spelling and grammar mistakes in this text. Return the whole corrected text and nothing else:"
    f"\n\n{_TYPOS}",
    f"Read the passage and answer by quoting the sentences that give the answer.\n\nPassage: {_PASSAGE}\n\n"
    "Question: What did the lamp burn, and when did the last keeper leave?",
    f"Add type hints to this Python function. Return the whole function:\n\n```python\n{_CODE}\n```",
    f"Rename the variable `totals` to `spend_by_customer` in this code and return the whole code:\n\n"
    f"```python\n{_CODE}\n```",
    f"Convert this CSV into a markdown table with the same rows:\n\n{_CSV}",
    f"Rewrite the paragraph below in the past tense, keeping everything else the same:\n\n{_TYPOS}",
    f"Copy the passage below, putting each sentence on its own line:\n\n{_PASSAGE}",
]

