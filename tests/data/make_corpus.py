"""How queries.jsonl and passages.jsonl were made: run once, committed; the tests only read the files.

The English text is CPython's own standard library (docstrings and source, under the Python Software
Foundation License), read with `ast` from the running interpreter's Lib folder, never imported. Beside it,
texts written for this suite: questions as people type them, other scripts (CJK, Cyrillic, Greek, Arabic,
Hindi), emoji, accents and whitespace oddities. Everything is chosen and shuffled with a fixed seed, so
the same Python version makes the same files: ``python tests/data/make_corpus.py``.

What the mix is for: the model tests compare vectors per text, and what varies the code path is the token
count (every padding step from 3 to 256 tokens, and past the max input length, where truncation acts),
the script and the characters, not how many texts there are. Queries are 2 to ~40 words; passages run
from one line to several thousand characters (a third of them past 256 tokens), with code among them.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).parent
SEED = 20240601
N_QUERIES, N_PASSAGES = 300, 150

WRITTEN_QUERIES = [
    "how do I read a file line by line in python",
    "what is the difference between a list and a tuple",
    "best way to parse dates with time zones",
    "why does my regular expression match too much",
    "convert a string to bytes utf-8",
    "sort a dictionary by value descending",
    "is there a thread-safe queue in the standard library?",
    "How can I measure how long a function takes to run?",
    "difference between deepcopy and copy",
    "what does the GIL actually protect",
    "retry an HTTP request with exponential backoff",
    "cosine similarity between two embedding vectors",
    "fastest way to remove duplicates from a list while keeping order",
    "open a sqlite database in read-only mode",
    "Why is 0.1 + 0.2 not equal to 0.3?",
    "generate a random password that is secure",
    "async generator vs. regular generator",
    "how to make a CLI with subcommands",
    "unzip a .tar.gz archive into a folder",
    "what happens when a process receives SIGTERM",
    "hash a password before storing it",
    "pretty print nested JSON",
    "count words in a text file",
    "wie öffne ich eine Datei mit Umlauten im Namen",
    "comment lire un fichier CSV avec des accents",
    "¿cómo se calcula la media de una lista?",
    "как прочитать файл в кодировке cp1251",
    "Πώς μετατρέπω μια συμβολοσειρά σε αριθμό;",
    "如何在 Python 中读取 JSON 文件",
    "Pythonで文字列を日付に変換する方法",
    "파이썬 리스트 정렬 방법",
    "كيف أقرأ ملفًا نصيًا في بايثون",
    "पायथन में सूची को कैसे क्रमबद्ध करें",
    "naïve café résumé façade — accents in file names",
    "emoji in filenames 🙂 breaks my script 🚀",
    "tabs\tversus   spaces",
    "x",
    "??",
    "re.sub(r'\\s+', ' ', text)",
    "for i, (a, b) in enumerate(zip(xs, ys)):",
    "SELECT name FROM users WHERE id = ?",
    "TypeError: 'NoneType' object is not subscriptable",
    "pip install fails with externally-managed-environment",
]

WRITTEN_PASSAGES = [
    "Embedding models map a piece of text to a vector of fixed length, so that texts with similar meaning "
    "end up close to each other. Search then becomes a nearest-neighbour lookup: embed the query, compare "
    "it with the stored passage vectors by cosine similarity, and return the closest ones.",
    "向量检索把文本转换成固定长度的向量。语义相近的句子，其向量之间的余弦相似度也更高。"
    "构建检索系统时，先为每个段落计算嵌入，再把查询的嵌入与它们比较，取最相近的几个结果。",
    "日本語の文章を埋め込みベクトルに変換すると、意味の近い文同士が近くに配置されます。"
    "検索では、まず質問をベクトルにし、保存された段落のベクトルと比較して、最も近いものを返します。",
    "Векторные представления текста позволяют искать документы по смыслу, а не по точному совпадению "
    "слов. Запрос и документы переводятся в векторы, после чего сравнивается косинусное сходство.",
    "Η αναζήτηση με διανύσματα μετατρέπει κάθε κείμενο σε ένα σημείο στον χώρο, ώστε κείμενα με "
    "παρόμοιο νόημα να βρίσκονται κοντά. Ένα ερώτημα συγκρίνεται με όλα τα αποθηκευμένα διανύσματα.",
    "يحوّل نموذج التضمين النص إلى متجه ثابت الطول، بحيث تكون النصوص المتشابهة في المعنى متقاربة. "
    "ثم يصبح البحث مقارنة بين متجه السؤال ومتجهات الفقرات المخزنة.",
    "Release notes 🎉: faster start-up ⚡, fewer crashes 🐛➡️✅, and a new logo 🦄. "
    "Thanks to everyone who tested the beta 🙏 — see you at the next meetup 👩‍💻👨‍💻!",
    "   Leading spaces,\ttabs,\n\nblank lines,   and\u3000an ideographic space;\u00a0a no-break space; "
    "zero\u200bwidth joiners; trailing spaces too.    ",
    "Ünïcödé àçcénts: Ærøskøbing, Łódź, Škoda, Çanakkale, Nguyễn, Þórr, straße, œuvre, ĳssel.",
    "def cosine(a: list[float], b: list[float]) -> float:\n"
    '    """Cosine similarity of two vectors of the same length."""\n'
    "    dot = sum(x * y for x, y in zip(a, b))\n"
    "    na = sum(x * x for x in a) ** 0.5\n"
    "    nb = sum(y * y for y in b) ** 0.5\n"
    "    return dot / (na * nb) if na and nb else 0.0\n",
    "#include <stdio.h>\n\nint main(void) {\n    for (int i = 0; i < 3; i++)\n"
    '        printf("%d\\n", i * i);\n    return 0;\n}\n',
    "curl -s http://127.0.0.1:8000/v1/embeddings -H 'Content-Type: application/json' "
    '-d \'{"input": ["first text", "second text"], "model": "all-MiniLM-L6-v2"}\' | jq .data[0].embedding',
    " ".join(["repeated"] * 700),
]


def _stdlib_files() -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "tkinter", "ensurepip")
    files = [p for p in lib.rglob("*.py") if not any(part in skip for part in p.relative_to(lib).parts)]
    return sorted(files)


def _clean(text: str) -> str:
    lines = [ln.rstrip() for ln in text.strip().splitlines()]
    return "\n".join(lines).strip()


def _docstrings_and_code() -> tuple[list[str], list[str], list[str]]:
    """(first sentences, whole docstrings, function sources) from the standard library."""
    sentences, docs, code = [], [], []
    for file in _stdlib_files():
        try:
            source = file.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if doc and "copyright" not in doc.lower() and "license" not in doc.lower():
                doc = _clean(doc)
                first = re.split(r"(?<=[.!?])\s", doc.split("\n\n")[0].replace("\n", " "))[0].strip()
                if 3 <= len(first.split()) <= 40 and first[0].isalpha():
                    sentences.append(first)
                if len(doc) >= 40:
                    docs.append(doc)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                segment = ast.get_source_segment(source, node)
                if segment and 200 <= len(segment) <= 3000:
                    code.append(segment)
    return sorted(set(sentences)), sorted(set(docs)), sorted(set(code))


def build() -> tuple[list[str], list[str]]:
    rng = random.Random(SEED)
    sentences, docs, code = _docstrings_and_code()
    queries = rng.sample(sentences, N_QUERIES - len(WRITTEN_QUERIES)) + WRITTEN_QUERIES
    # Passages by length: a third short (< 400 chars), a third medium, a third long (> 1500 chars, past
    # the 256 tokens all-MiniLM-L6-v2 keeps), plus function sources and the written ones.
    n_code = 20
    n_docs = N_PASSAGES - len(WRITTEN_PASSAGES) - n_code
    short = [d for d in docs if len(d) < 400]
    medium = [d for d in docs if 400 <= len(d) <= 1500]
    long = [d for d in docs if 1500 < len(d) <= 8000]
    third = n_docs // 3
    passages = (
        rng.sample(short, third)
        + rng.sample(medium, third)
        + rng.sample(long, n_docs - 2 * third)
        + rng.sample(code, n_code)
        + WRITTEN_PASSAGES
    )
    rng.shuffle(queries)
    rng.shuffle(passages)
    return queries, passages


def write(path: Path, texts: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    queries, passages = build()
    write(HERE / "queries.jsonl", queries)
    write(HERE / "passages.jsonl", passages)
    print(f"python {sys.version.split()[0]}: {len(queries)} queries, {len(passages)} passages")
