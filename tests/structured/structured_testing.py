"""What the structured-output tests share: the SQL-shaped grammar of the seed's example, and
a run of one request that counts the engine's steps (jump-forward saves steps)."""

from __future__ import annotations

SQL = """
    ?start: select_statement
    ?select_statement: "SELECT " column_list " FROM " table_name
    ?column_list: column_name ("," column_name)*
    ?table_name: identifier
    ?column_name: identifier
    ?identifier: /[a-zA-Z_][a-zA-Z0-9_]*/
"""


def run_counting_steps(llm, prompt, params) -> tuple[str, int]:
    """The finished text of one request run alone on `llm`'s engine, and how many steps it took."""
    engine = llm.engine
    engine.add_request("counted", prompt, params)
    steps, text = 0, None
    while engine.has_unfinished_requests():
        steps += 1
        for output in engine.step():
            if output.finished:
                text = output.outputs[0].text
    return text, steps
