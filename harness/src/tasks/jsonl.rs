//! Users' own problems: one JSON object per line, `{"prompt": "...", "answer": "..."}` with an
//! optional `"meta"` object (e.g. Countdown's numbers and target). Blank lines are skipped.
//! Every problem is checked by the task's verifier at load time, so a bad line is reported by
//! its number before any evaluation runs.

use std::path::Path;

use super::{Problem, TaskError, Verdict, Verifier};

/// Names of the JSONL fields holding a problem's prompt and its answer (Slime's
/// `--input-key` / `--label-key`), so an existing data file is read as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonlKeys {
    /// Field of the prompt text.
    pub input: String,
    /// Field of the reference answer (a string or an integer).
    pub label: String,
}

impl Default for JsonlKeys {
    fn default() -> Self {
        Self {
            input: "prompt".into(),
            label: "answer".into(),
        }
    }
}

/// Parses JSONL text into problems checked by `verifier` (fields `prompt` and `answer`).
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
    parse_jsonl_with(text, verifier, &JsonlKeys::default())
}

/// [`parse_jsonl`] with the prompt and answer read from the fields `keys` names. Other fields
/// are ignored, except `meta` (e.g. Countdown's numbers and target). Each problem must pass
/// the task's own checks: a well-formed answer the task's verifier marks wrong (`12+34=` with
/// answer `47`) refuses the file, naming the line.
pub fn parse_jsonl_with(
    text: &str,
    verifier: &dyn Verifier,
    keys: &JsonlKeys,
) -> Result<Vec<Problem>, TaskError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| TaskError::Jsonl { line, reason };
        let value: serde_json::Value = serde_json::from_str(raw).map_err(|e| bad(e.to_string()))?;
        let obj = value
            .as_object()
            .ok_or_else(|| bad("expected a JSON object".into()))?;
        let prompt = match obj.get(&keys.input) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(_) => return Err(bad(format!("field {:?} must be a string", keys.input))),
            None => return Err(bad(format!("missing field {:?} (the prompt)", keys.input))),
        };
        let answer = match obj.get(&keys.label) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
            Some(_) => {
                return Err(bad(format!(
                    "field {:?} must be a string or an integer",
                    keys.label
                )));
            }
            None => return Err(bad(format!("missing field {:?} (the answer)", keys.label))),
        };
        let problem = Problem {
            prompt,
            answer,
            meta: obj.get("meta").cloned().unwrap_or(serde_json::Value::Null),
        };
        verifier
            .check_problem(&problem)
            .map_err(|e| bad(e.to_string()))?;
        // The reference answer, given as a response, must not be judged wrong by the checker.
        // (Malformed is allowed: e.g. a Countdown answer may be a placeholder.)
        if let Verdict::Incorrect(why) = verifier.verify(&problem, &problem.answer) {
            return Err(bad(format!(
                "answer {:?} fails the task's checker: {why}",
                problem.answer
            )));
        }
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
    load_jsonl_with(path, verifier, &JsonlKeys::default())
}

/// [`load_jsonl`] with configurable field names (see [`parse_jsonl_with`]).
pub fn load_jsonl_with(
    path: &Path,
    verifier: &dyn Verifier,
    keys: &JsonlKeys,
) -> Result<Vec<Problem>, TaskError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| TaskError::Io(format!("cannot read {}: {e}", path.display())))?;
    parse_jsonl_with(&text, verifier, keys).map_err(|e| match e {
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
            ("{\"prompt\": \"12+34=\", \"answer\": \"47\"}\n", 1),
            (
                "{\"prompt\": \"1+1=\", \"answer\": 2}\n{\"q\": \"1+1=\"}\n",
                2,
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
    fn wrong_answers_are_refused_and_field_names_are_configurable() {
        let add = task_by_name("add", &TaskOptions::default()).unwrap();
        let err = parse_jsonl("{\"prompt\": \"12+34=\", \"answer\": \"47\"}", add.as_ref())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("line 1") && err.contains("12+34 = 46"),
            "{err}"
        );
        let mul = task_by_name("mul", &TaskOptions::default()).unwrap();
        assert!(parse_jsonl("{\"prompt\": \"3*4=\", \"answer\": 7}", mul.as_ref()).is_err());
        // A Slime-style file with its own field names and extra fields, read as it is.
        let keys = JsonlKeys {
            input: "question".into(),
            label: "label".into(),
        };
        let text = "{\"id\": 1, \"question\": \"12+34=\", \"label\": \"46\"}\n";
        let ps = parse_jsonl_with(text, add.as_ref(), &keys).unwrap();
        assert_eq!(
            (ps[0].prompt.as_str(), ps[0].answer.as_str()),
            ("12+34=", "46")
        );
        let err = parse_jsonl(text, add.as_ref()).unwrap_err().to_string();
        assert!(err.contains("\"prompt\""), "{err}");
        // Countdown: a reference expression that misses the target is refused.
        let cd = task_by_name("countdown", &TaskOptions::default()).unwrap();
        let bad = "{\"prompt\": \"reach ten\", \"answer\": \"5+2\", \"meta\": {\"numbers\": [2, 5], \"target\": 10}}";
        assert!(parse_jsonl(bad, cd.as_ref()).is_err());
    }

    #[test]
    fn load_reports_path() {
        let add = task_by_name("add", &TaskOptions::default()).unwrap();
        let err = load_jsonl(Path::new("/nonexistent/problems.jsonl"), add.as_ref()).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/problems.jsonl"));
    }
}
