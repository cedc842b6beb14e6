"""Input-grounded chat prompts for benchmarks/bench_spec_ngram_real.py: an instruction to
edit, rewrite or summarise a given text, followed by that text (written for this benchmark).
Answers to such prompts copy long runs of their input, which is what n-gram prompt lookup
drafts from."""
from __future__ import annotations

TYPO_PARAGRAPH = """\
The city council met on Tuesday evning to discuss the new budjet for the public library. \
Several members argued that the library's opening hours shoud be extended, because many \
students have nowhere quiet to study after school. Others pointed out that the building \
needs a new roof before winter, and that the repairs will cost more then the council had \
planned. After a long debate, the council agreed to fund the roof first and to revisit the \
opening hours in the spring, when the results of a survey of library users will be avaliable. \
The head librarian said she was dissapointed but understood the decision. She added that \
volunteers from the neighbourhood have offered to run a reading club on Saturday mornings, \
which will not cost the city anything, and that the club will start next month. The \
council thanked the volunteers and asked the librarian to report back on how many people \
atend the first sessions."""

TYPO_EMAIL = """\
Hi Sam,

Thanks for sending the draft of the quartely report. I read it on the train this morning \
and I think it is in good shape overal. A few small things: the table on page three has \
the sales figures for March and April in the wrong order, and the chart below it uses a \
diffrent colour for the northern region than the chart on page two. Could you make them \
match? Also, the paragraph about the new warehouse says it will open in Septmber, but \
Maria told me yesterday that the opening has moved to October becuase the permits are \
delayed. Please check with her before we send it out. Finally, I would add one sentence \
to the summary about the custmer survey, since the results were much better than last \
year and the board will want to know. Apart from that, I think we can send the report to \
the board on Friday as planned. Let me know if you need any help with the changes.

Best regards,
Alex"""

CODE = """\
def f(a, b):
    r = []
    for x in a:
        t = 0
        for y in x:
            if y > b:
                t = t + y
        r.append(t)
    return r


def g(d):
    out = {}
    for k in d:
        v = d[k]
        if v is None:
            continue
        s = str(v).strip()
        if s == "":
            continue
        out[k.lower()] = s
    return out


def h(lst, n):
    res = []
    tmp = []
    for item in lst:
        tmp.append(item)
        if len(tmp) == n:
            res.append(tmp)
            tmp = []
    if tmp:
        res.append(tmp)
    return res
"""

ARTICLE = """\
Honeybees are among the most studied insects in the world, yet they still surprise the \
scientists who work with them. A colony can hold tens of thousands of workers, a single \
queen and, in summer, a few hundred drones. The workers change jobs as they age: young \
bees clean cells and feed larvae, middle-aged bees build comb and guard the entrance, and \
the oldest bees fly out to collect nectar and pollen. When a forager finds a rich patch \
of flowers, she returns to the hive and performs a waggle dance, whose angle tells the \
other bees the direction of the food relative to the sun and whose length tells them the \
distance. Researchers first decoded the dance in the 1940s, and later experiments with \
robotic bees confirmed that the dance alone is enough to send recruits to the right place. \
In winter the colony forms a tight cluster and the bees shiver their flight muscles to \
keep the centre warm, eating the honey they stored in summer. A strong colony needs about \
twenty kilograms of honey to survive a cold winter. Beekeepers worry about several \
threats: a parasitic mite that spreads viruses, the loss of wild flowers, and some \
pesticides that impair the bees' ability to find their way home. Many farmers now plant \
strips of flowers beside their fields, which helps wild bees as well as honeybees."""

MEETING_NOTES = """\
Project meeting, 14 March. Present: Priya, Tom, Chen, Laura.
- Priya reported that the mobile app passed its security review; two minor issues remain \
and will be fixed by 21 March.
- Tom said the payment provider will switch to its new interface on 1 April. Our code \
must be updated and tested before 28 March.
- Chen showed the new onboarding screens. Users in the pilot finished sign-up in 2 minutes \
on average, down from 5 minutes.
- Laura raised the budget: the cloud bill rose by 18 percent last month because of the \
test environments that were left running. She will set up automatic shutdown by 18 March.
- The team agreed to move the public launch from 3 April to 10 April to leave time for \
the payment change.
- Next meeting: 21 March, same time. Tom will send the agenda on 20 March."""

JSON_ITEMS = """\
[
  {"id": 101, "title": "Order new chairs for the meeting room", "owner": "Dana", "status": "open"},
  {"id": 102, "title": "Renew the software licences", "owner": "Eli", "status": "open"},
  {"id": 103, "title": "Fix the broken projector", "owner": "Dana", "status": "in progress"},
  {"id": 104, "title": "Plan the summer team lunch", "owner": "Fay", "status": "open"},
  {"id": 105, "title": "Update the office floor plan", "owner": "Gus", "status": "open"},
  {"id": 106, "title": "Collect feedback on the new coffee machine", "owner": "Eli", "status": "open"},
  {"id": 107, "title": "Archive last year's invoices", "owner": "Fay", "status": "in progress"},
  {"id": 108, "title": "Book the training room for May", "owner": "Gus", "status": "open"}
]"""

# (instruction, text): eight input-grounded tasks, every text used at least once
TASKS: list[tuple[str, str]] = [
    ("Fix the typos in this paragraph and return the corrected paragraph:", TYPO_PARAGRAPH),
    ("Fix the spelling mistakes in this email and return the whole email:", TYPO_EMAIL),
    ("Rewrite this code with better names for the functions and variables:", CODE),
    ("Summarise this text, quoting its key sentences:", ARTICLE),
    ("List every action item in these notes with its owner and date, quoting the notes:", MEETING_NOTES),
    ("Return this JSON with the status of every item owned by Dana set to \"done\":", JSON_ITEMS),
    ("Add a short docstring to each function in this code and return the whole code:", CODE),
    ("Rewrite this paragraph in the past tense, changing nothing else:", ARTICLE),
]


def chat_messages() -> list[list[dict]]:
    """One single-turn conversation a task: the instruction, a blank line, the text."""
    return [[{"role": "user", "content": f"{instruction}\n\n{text}"}] for instruction, text in TASKS]
