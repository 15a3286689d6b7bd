"""Text-to-SQL over SQLite: an ordinary LangGraph flow, writer -> checker -> rewriter, all one chat model.

Each node is a LangChain `ChatOpenAI` call (pointed at the runtime's server) with its own prompt. The checker
runs the query and asks the model whether the result answers the question; unless it says OK, the rewriter writes
a new query from that feedback. The lightning-sdk code is the two decorators and one `ls.component` name per node:
lightning.toml trains the writer and the rewriter only, so the checker's calls are traced but not trained.
"""

import re
import sqlite3
from pathlib import Path
from typing import TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

import lightning_sdk as ls

DATA = Path(__file__).parent / "data"


class State(TypedDict, total=False):
    question: str
    db: str
    query: str
    result: str
    verdict: str


def schema(db: str) -> str:
    """Tables as `name(col, col, ...)`, the compact form text-to-SQL prompts use."""
    with sqlite3.connect(DATA / db) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return "\n".join(f"{t}({', '.join(c[1] for c in con.execute(f'PRAGMA table_info({t})'))})" for t in tables)


def execute(db: str, query: str) -> list[tuple]:
    # Read-only: a generated query must never change the shipped database.
    with sqlite3.connect(f"file:{DATA / db}?mode=ro", uri=True) as con:
        return con.execute(query).fetchmany(20)


def run_query(db: str, query: str) -> str:
    try:
        return repr(execute(db, query))
    except sqlite3.Error as e:
        return f"error: {e}"


def sql_of(text: str) -> str:
    """The query in a reply: a ```sql block if there is one, else the text from SELECT on."""
    block = re.search(r"```(?:sql)?\s*(.*?)```", text, re.S | re.I)
    if block:
        return block.group(1).strip()
    start = text.upper().find("SELECT")
    return text[start:].strip() if start >= 0 else text.strip()


def build_graph(llm: ls.LLM):
    model = ChatOpenAI(model=llm.model, base_url=llm.base_url, api_key=llm.api_key, temperature=1.0,
                       max_tokens=64, max_retries=0)

    @ls.component("writer")
    async def writer(state: State) -> State:
        reply = await model.ainvoke([
            SystemMessage("Write one SQLite query that answers the question. Reply with the query only."),
            HumanMessage(f"{schema(state['db'])}\nQuestion: {state['question']}"),
        ])
        query = sql_of(reply.content)
        return {"query": query, "result": run_query(state["db"], query)}

    @ls.component("checker")
    async def checker(state: State) -> State:
        reply = await model.ainvoke([
            SystemMessage("Does the query answer the question? Reply OK, or say what is wrong."),
            HumanMessage(f"Question: {state['question']}\nQuery: {state['query']}\nResult: {state['result'][:100]}"),
        ])
        return {"verdict": reply.content.strip()}

    @ls.component("rewriter")
    async def rewriter(state: State) -> State:
        reply = await model.ainvoke([
            SystemMessage("Fix the SQLite query. Reply with the query only."),
            HumanMessage(f"{schema(state['db'])}\nQuestion: {state['question']}\nQuery: {state['query']}\n"
                         f"Result: {state['result'][:100]}\nProblem: {state['verdict'][:100]}"),
        ])
        query = sql_of(reply.content)
        return {"query": query, "result": run_query(state["db"], query)}

    graph = StateGraph(State)
    graph.add_node("writer", writer)
    graph.add_node("checker", checker)
    graph.add_node("rewriter", rewriter)
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "checker")
    graph.add_conditional_edges("checker", lambda s: END if s["verdict"].upper().startswith("OK") else "rewriter")
    graph.add_edge("rewriter", END)
    return graph.compile()


@ls.rollout
async def solve(task: dict, llm: ls.LLM) -> str:
    final = await build_graph(llm).ainvoke({"question": task["question"], "db": task["db"]})
    return final["query"]


@ls.reward
def execution_match(task: dict, query: str) -> float:
    """1 when the query returns the gold query's rows (order ignored), else 0."""
    try:
        got = execute(task["db"], query)
    except (sqlite3.Error, sqlite3.Warning, ValueError):
        return 0.0
    return float(sorted(map(repr, got)) == sorted(map(repr, execute(task["db"], task["gold"]))))
