//! Users' own problems: one JSON object per line, `{"prompt": "...", "answer": "..."}` with an
//! optional `"meta"` object (e.g. Countdown's numbers and target). Blank lines are skipped.
//! Every problem is checked by the task's verifier at load time, so a bad line is reported by
//! its number before any evaluation runs.

use std::path::Path;

use serde::Deserialize;

use super::{Problem, TaskError, Verifier};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    prompt: String,
    answer: Answer,
    #[serde(default)]
    meta: serde_json::Value,
}

/// Answers may be written as JSON numbers for convenience (`"answer": 42`).
#[derive(Deserialize)]
#[serde(untagged)]
enum Answer {
    Text(String),
    Int(i64),
}

/// Parses JSONL text into problems checked by `verifier`.
///
/// ```
/// use rolloutpipe_harness::tasks::{parse_jsonl, task_by_name, TaskOptions};
/// let add = task_by_name("add", &TaskOptions::default()).unwrap();
/// let ps = parse_jsonl("{\"prompt\": \"1+2=\", \"answer\": \"3\"}\n\n{\"prompt\": \"2+2=\", \"answer\": 4}\n", add.as_ref()).unwrap();
/// assert_eq!(ps.len(), 2);
/// let err = parse_jsonl("{\"prompt\": \"1+2=\"}\n", add.as_ref()).unwrap_err();
/// assert!(err.to_string().starts_with("line 1:"));
/// ```
pub fn parse_jsonl(text: &str, verifier: &dyn Verifier) -> Result<Vec<Problem>, TaskError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let parsed: Line = serde_json::from_str(raw).map_err(|e| TaskError::Jsonl {
            line,
            reason: e.to_string(),
        })?;
        let answer = match parsed.answer {
            Answer::Text(s) => s,
            Answer::Int(n) => n.to_string(),
        };
        let problem = Problem {
            prompt: parsed.prompt,
            answer,
            meta: parsed.meta,
        };
        verifier
            .check_problem(&problem)
            .map_err(|e| TaskError::Jsonl {
                line,
                reason: e.to_string(),
            })?;
        out.push(problem);
    }
    if out.is_empty() {
        return Err(TaskError::Jsonl {
            line: 0,
            reason: "no problems in file".into(),
        });
    }
    Ok(out)
}

/// Reads and parses a JSONL problem file (see [`parse_jsonl`]).
pub fn load_jsonl(path: &Path, verifier: &dyn Verifier) -> Result<Vec<Problem>, TaskError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| TaskError::Io(format!("cannot read {}: {e}", path.display())))?;
    parse_jsonl(&text, verifier).map_err(|e| match e {
        TaskError::Jsonl { line, reason } => TaskError::Jsonl {
            line,
            reason: format!("{}: {reason}", path.display()),
        },
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::{TaskOptions, task_by_name};

    #[test]
    fn errors_name_the_line() {
        let cd = task_by_name("countdown", &TaskOptions::default()).unwrap();
        let text = "{\"prompt\": \"3 7>21:\", \"answer\": \"3*7\"}\n\n{\"prompt\": \"hello\", \"answer\": \"1\"}\n";
        match parse_jsonl(text, cd.as_ref()) {
            Err(TaskError::Jsonl { line: 3, reason }) => {
                assert!(reason.contains("countdown prompt"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        let add = task_by_name("add", &TaskOptions::default()).unwrap();
        for (text, line) in [
            ("not json\n", 1),
            (
                "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": 3, \"answer\": \"2\"}\n",
                2,
            ),
            ("{\"prompt\": \"1+1=\", \"answer\": \"two\"}\n", 1),
            (
                "{\"prompt\": \"1+1=\", \"answer\": \"2\", \"extra\": 1}\n",
                1,
            ),
            ("\n\n", 0),
        ] {
            match parse_jsonl(text, add.as_ref()) {
                Err(TaskError::Jsonl { line: l, .. }) => assert_eq!(l, line, "{text:?}"),
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn meta_is_kept_and_used() {
        let cd = task_by_name("countdown", &TaskOptions::default()).unwrap();
        let text = "{\"prompt\": \"reach ten\", \"answer\": \"x\", \"meta\": {\"numbers\": [2, 5], \"target\": 10}}";
        let ps = parse_jsonl(text, cd.as_ref()).unwrap();
        assert!(cd.verify(&ps[0], "5*2").is_correct());
        assert!(!cd.verify(&ps[0], "5+2").is_correct());
    }

    #[test]
    fn load_reports_path() {
        let add = task_by_name("add", &TaskOptions::default()).unwrap();
        let err = load_jsonl(Path::new("/nonexistent/problems.jsonl"), add.as_ref()).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/problems.jsonl"));
    }
}
