"""Write data/conversations.jsonl: deterministic synthetic OpenAI-style chats.

Stdlib only (random with a fixed seed). Each conversation draws a target
length from a lognormal, then fills system/user/assistant messages with
templated English-like sentences, code blocks, numbers and lists until the
budget is spent. Lengths are budgeted in characters (~3.3 chars per token
with the demo tokenizer), giving ~20-2000 tokens after chat templating.

    python make_demo_data.py [--n 700] [--seed 1234] [--out data/conversations.jsonl]
"""

import argparse
import json
import math
import os
import random
import re

CHARS_PER_TOKEN = 3.3  # rough calibration for the 1024-vocab demo tokenizer
MIN_TOKENS, MAX_TOKENS = 18, 1550  # target clamp; real lengths vary ~+-20% by topic

TOPICS = {
    "code": dict(
        nouns="function list dictionary loop variable class module test parser server request cache index query "
        "string buffer thread process file exception iterator decorator generator array pointer compiler".split(),
        verbs="refactor debug optimize parse sort filter cache compile validate serialize import profile "
        "benchmark rewrite document".split(),
        adjs="recursive slow fast nested mutable immutable async lazy generic empty broken typed".split(),
    ),
    "math": dict(
        nouns="equation integral derivative matrix vector prime fraction sequence series proof limit function "
        "polynomial angle triangle probability average variance".split(),
        verbs="solve simplify factor integrate differentiate prove estimate compute expand approximate".split(),
        adjs="linear quadratic convergent finite infinite rational irrational orthogonal symmetric".split(),
    ),
    "travel": dict(
        nouns="city train flight hotel museum beach mountain village ticket passport itinerary market island "
        "river bridge castle festival ferry hostel".split(),
        verbs="visit book explore reserve pack plan cross hike photograph rent".split(),
        adjs="quiet crowded historic scenic cheap expensive remote coastal charming busy".split(),
    ),
    "cooking": dict(
        nouns="recipe sauce dough oven pan garlic onion butter flour rice soup bread salad pasta spice "
        "tomato lemon chicken cheese".split(),
        verbs="bake boil chop stir roast simmer whisk season knead fry marinate".split(),
        adjs="crispy tender spicy sweet salty fresh creamy golden savory smoky".split(),
    ),
    "science": dict(
        nouns="cell atom molecule planet star energy experiment hypothesis particle gene protein climate "
        "ocean volcano orbit galaxy enzyme reaction".split(),
        verbs="measure observe predict test model explain replicate classify analyze simulate".split(),
        adjs="stable unstable dense massive microscopic thermal magnetic organic chemical".split(),
    ),
    "finance": dict(
        nouns="budget loan interest savings account invoice tax salary stock bond mortgage expense "
        "portfolio dividend rent insurance".split(),
        verbs="save invest borrow track reduce pay calculate compare allocate diversify".split(),
        adjs="monthly annual fixed variable risky safe taxable net gross".split(),
    ),
    "fitness": dict(
        nouns="workout run muscle stretch routine sleep diet protein squat plank interval recovery "
        "heart rate marathon bike".split(),
        verbs="train stretch lift recover run swim warm track rest improve".split(),
        adjs="intense light steady daily weekly aerobic gentle strong".split(),
    ),
    "history": dict(
        nouns="empire treaty war king queen revolution trade route city manuscript dynasty republic "
        "battle harbor canal".split(),
        verbs="rule conquer trade build defend sign collapse expand record unite".split(),
        adjs="ancient medieval colonial powerful famous decisive maritime rural".split(),
    ),
}

CONNECT = ["However,", "In practice,", "For example,", "Also,", "First,", "Then,", "Finally,", "Note that",
           "In short,", "As a rule,", "Usually,", "If possible,"]
ADVS = ["carefully", "quickly", "slowly", "usually", "often", "rarely", "always", "gently", "twice", "again"]
SENT = [
    "{C} you should {v} the {a} {n} before you {v2} the {n2}.",
    "The {n} is {a} because the {n2} was {a2}.",
    "{C} try to {v} each {n} {adv}; it makes the {n2} {a}.",
    "A {a} {n} can {v} a {n2} in about {num} minutes.",
    "Most people {v} the {n} {adv}, but a {a} {n2} works better.",
    "{C} the {n} and the {n2} depend on each other.",
    "If the {n} looks {a}, {v} it and check the {n2} again.",
    "There are {num} ways to {v} a {a} {n}, and the simplest one uses a {n2}.",
    "{C} keep the {n} {a} and the {n2} {a2}.",
    "Roughly {pct}% of the {ns} I have seen were {a}.",
]
QUESTIONS = [
    "How do I {v} a {a} {n}?",
    "Can you explain why my {n} is so {a}?",
    "What is the best way to {v} the {n} and the {n2}?",
    "Why does the {n} {v} when the {n2} is {a}?",
    "Could you give me {num} tips to {v} a {n}?",
    "Is it better to {v} or to {v2} the {n}?",
    "I need help with a {a} {n}. Any ideas?",
    "What should I know before I {v} a {n} with {num} {n2s}?",
]
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly and accurately.",
    "You are an expert tutor. Explain step by step.",
    "You are a friendly assistant who likes examples.",
    "You are a coding assistant. Prefer short, working code.",
]
SHORT = [  # very short exchanges (<40 tokens after templating)
    ("Hi!", "Hello! How can I help you today?"), ("Thanks a lot.", "You're welcome, happy to help!"),
    ("What is 2+2?", "2 + 2 = 4."), ("Say yes, please.", "Yes, of course."), ("Name a color.", "Blue is a nice color."),
    ("Ok, bye for now.", "Goodbye, see you soon!"), ("Is 7 prime?", "Yes, 7 is a prime number."),
]
IDENT = "data value item count total result node key name size index buf acc tmp".split()


def plural(w):
    if re.search(r"[^aeiou]y$", w):
        return w[:-1] + "ies"
    return w + ("es" if re.search(r"(s|sh|ch|x)$", w) else "s")


def fill(rng, tpl, t):
    """Fill a template with words from topic t (fixed draw order keeps output deterministic)."""
    n, n2 = rng.choice(t["nouns"]), rng.choice(t["nouns"])
    s = tpl.format(
        C=rng.choice(CONNECT), adv=rng.choice(ADVS), num=rng.randint(2, 12), pct=rng.randint(5, 95),
        n=n, n2=n2, ns=plural(n), n2s=plural(n2), v=rng.choice(t["verbs"]),
        v2=rng.choice(t["verbs"]), a=rng.choice(t["adjs"]), a2=rng.choice(t["adjs"]),
    )
    return re.sub(r"\b([Aa]) (?=[aeiou])", r"\1n ", s)  # a -> an


def code_block(rng):
    """A small, plausible-looking Python or shell snippet."""
    if rng.random() < 0.2:
        cmd = rng.choice(["pip install", "git clone", "ls -la", "grep -rn", "python -m pytest", "curl -s"])
        return f"```bash\n{cmd} {rng.choice(IDENT)}_{rng.randint(1, 99)}\n```"
    a, b, fn = rng.choice(IDENT), rng.choice(IDENT), rng.choice(["compute", "load", "merge", "parse", "scale"])
    k = rng.randint(2, 9)
    lines = [f"def {fn}_{a}({a}, {b}={k}):", f"    result = []",
             f"    for i in range({a}):", f"        if i % {b} == 0:",
             f"            result.append(i * {rng.randint(2, 50)})", f"    return sum(result) / max(len(result), 1)"]
    if rng.random() < 0.5:
        lines += ["", f"print({fn}_{a}({rng.randint(10, 999)}))  # -> {rng.randint(0, 9999)}"]
    return "```python\n" + "\n".join(lines) + "\n```"


def math_line(rng):
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*", "/"])
    val = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 3)}[op]
    return rng.choice([f"We get {a} {op} {b} = {val}.", f"So x = {val} when {a} {op} {b} is evaluated.",
                       f"Check: ({a} {op} {b}) = {val}, which rounds to {round(val)}."])


def paragraph(rng, topic, budget_chars, question=False):
    """Build text of roughly budget_chars characters for one message."""
    t = TOPICS[topic]
    parts, size = [], 0
    if question:
        parts.append(fill(rng, rng.choice(QUESTIONS), t))
        size = len(parts[0])
    while size < budget_chars:
        r = rng.random()
        if topic == "code" and r < 0.25 and budget_chars - size > 150:
            p = code_block(rng)
        elif topic in ("math", "finance") and r < 0.3:
            p = math_line(rng)
        elif r < 0.08 and budget_chars - size > 120:  # numbered list
            p = "\n".join(f"{i}. {fill(rng, rng.choice(SENT), t)}" for i in range(1, rng.randint(3, 6)))
        else:
            p = fill(rng, rng.choice(SENT), t)
        parts.append(p)
        size += len(p) + 1
    # join sentences into paragraphs; blocks/lists stand on their own
    out = ""
    for p in parts:
        sep = "\n\n" if (p.startswith(("```", "1.")) or out.endswith("```") or rng.random() < 0.15) else " "
        out = p if not out else out + sep + p
    return out


def conversation(rng):
    # lognormal token target, median ~230 tokens; a few forced very short ones
    if rng.random() < 0.02:
        u, a = rng.choice(SHORT)
        return [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    target = min(max(rng.lognormvariate(math.log(230), 0.85), MIN_TOKENS), MAX_TOKENS)
    n_turns = rng.choices([1, 2, 3, 4], weights=[4, 3, 2, 1])[0]
    n_turns = max(1, min(n_turns, int(target // 40)))  # short chats get fewer turns
    msgs = []
    if rng.random() < 0.4:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    budget = target * CHARS_PER_TOKEN - 15 * (2 * n_turns + len(msgs))  # template overhead
    per_turn = max(budget, 20) / n_turns
    topic = rng.choice(sorted(TOPICS))
    for _ in range(n_turns):
        if rng.random() < 0.2:  # topics sometimes drift mid-conversation
            topic = rng.choice(sorted(TOPICS))
        user_frac = rng.uniform(0.1, 0.35)
        msgs.append({"role": "user", "content": paragraph(rng, topic, per_turn * user_frac, question=True)})
        msgs.append({"role": "assistant", "content": paragraph(rng, topic, per_turn * (1 - user_frac))})
    return msgs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=700)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                                                  "conversations.jsonl"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for i in range(args.n):
            row = {"id": f"demo-{i:06d}", "messages": conversation(rng)}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {args.n} conversations to {args.out}")


if __name__ == "__main__":
    main()
