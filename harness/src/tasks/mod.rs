//! Verifiable tasks: problems generated from a seed with a disjoint held-out split,
//! exact verifiers that turn a model's response into a reward, tokenizers that turn text into
//! the ids the policy backends consume, and loading of users' own problems from JSONL.
//!
//! The reward interface is the [`Verifier`] trait: implement `verify` for your own checker and
//! [`Verifier::reward`] maps its [`Verdict`] to 1 (correct), 0 (incorrect) or minus the format
//! penalty (malformed). A [`Task`] adds seeded generation on top; [`task_by_name`] builds the
//! built-in ones (`add`, `mul`, `countdown`).
//!
//! ```
//! use rolloutpipe_harness::tasks::{generate, task_by_name, Split, TaskOptions, Verdict, Verifier};
//! let task = task_by_name("add", &TaskOptions::default()).unwrap();
//! let problems = generate(task.as_ref(), 7, Split::Train, 4).unwrap();
//! let p = &problems[0];
//! assert_eq!(task.verify(p, &p.answer), Verdict::Correct);
//! assert_eq!(task.reward(p, &p.answer), 1.0);
//! ```

mod arith;
mod countdown;
mod jsonl;
mod split;
mod teacher;
pub mod tokenizer;

use std::fmt;

use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

pub use arith::{AddTask, MulTask, uniform_problems};
pub use countdown::{CountdownTask, eval_countdown_expr};
pub use jsonl::{JsonlKeys, load_jsonl, load_jsonl_with, parse_jsonl, parse_jsonl_with};
pub use split::{Split, split_of};
pub use teacher::{apply_carry_dropping_teacher, carry_dropping_sum};
pub use tokenizer::{CharTokenizer, HfTokenizer, Tokenizer, TokenizerError};

/// One problem: what the model is shown, a reference answer, and task-specific data
/// (e.g. Countdown's numbers and target) that the verifier may use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// The text the model continues (its tokens form the group's prompt).
    pub prompt: String,
    /// A correct answer. For `add`/`mul` the exact number; for `countdown` one solving
    /// expression (any other correct expression is accepted too). Also the SFT target.
    pub answer: String,
    /// Task-specific data; `null` when the task needs none.
    #[serde(default)]
    pub meta: serde_json::Value,
}

/// What a verifier concluded about one response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The response is a verified answer.
    Correct,
    /// The response is well formed but not a correct answer (the reason says why).
    Incorrect(String),
    /// The response is not in the expected format (the reason says what is wrong).
    Malformed(String),
}

impl Verdict {
    /// Whether the response was verified correct.
    pub fn is_correct(&self) -> bool {
        matches!(self, Verdict::Correct)
    }
}

/// Errors of task construction, generation and problem loading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskError {
    /// No task has this name.
    UnknownTask {
        /// The name asked for.
        name: String,
    },
    /// A difficulty knob is out of its range.
    BadOption {
        /// The knob.
        option: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// A problem cannot be checked by this task (e.g. a Countdown prompt without numbers).
    BadProblem(String),
    /// The requested split never came up (held-out fraction 0, or a problem space too small).
    EmptySplit {
        /// The split asked for.
        split: Split,
        /// How many problems were drawn before giving up.
        draws: u64,
    },
    /// A line of a JSONL problem file is not a valid problem.
    Jsonl {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The problem file could not be read.
    Io(String),
}

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TaskError::UnknownTask { name } => {
                write!(
                    f,
                    "unknown task {name:?}; valid tasks: {}",
                    TASK_NAMES.join(", ")
                )
            }
            TaskError::BadOption { option, reason } => {
                write!(f, "bad task option {option}: {reason}")
            }
            TaskError::BadProblem(reason) => write!(f, "bad problem: {reason}"),
            TaskError::EmptySplit { split, draws } => write!(
                f,
                "no {split} problem after {draws} draws (held-out fraction or problem space too small)"
            ),
            TaskError::Jsonl { line, reason } => write!(f, "line {line}: {reason}"),
            TaskError::Io(reason) => write!(f, "{reason}"),
        }
    }
}

impl std::error::Error for TaskError {}

/// The reward interface: decides whether a response answers a problem. Implement this for a
/// custom reward; the provided [`Verifier::reward`] maps verdicts to rewards (1, 0, or
/// minus the format penalty).
pub trait Verifier: Send + Sync {
    /// Checks `response` (the decoded text after the prompt, stop token excluded) against
    /// `problem`. Must not panic on any input.
    fn verify(&self, problem: &Problem, response: &str) -> Verdict;

    /// Penalty subtracted for a malformed response (0 = no format penalty, the default).
    fn format_penalty(&self) -> f32 {
        0.0
    }

    /// Reward of a response: 1 verified, 0 incorrect, `-format_penalty()` malformed.
    fn reward(&self, problem: &Problem, response: &str) -> f32 {
        match self.verify(problem, response) {
            Verdict::Correct => 1.0,
            Verdict::Incorrect(_) => 0.0,
            Verdict::Malformed(_) => -self.format_penalty(),
        }
    }

    /// Checks that a problem (e.g. a user's, from JSONL) carries what `verify` needs.
    fn check_problem(&self, problem: &Problem) -> Result<(), TaskError> {
        let _ = problem;
        Ok(())
    }
}

/// A task: a verifier plus a seeded problem generator.
pub trait Task: Verifier {
    /// The registry name (`add`, `mul`, `countdown`).
    fn name(&self) -> &str;

    /// Draws one problem uniformly from the task's problem space (both splits).
    fn sample(&self, rng: &mut ChaCha8Rng) -> Problem;

    /// Identity of a problem for the held-out split: problems with the same key are the same
    /// problem (e.g. `3+4` and `4+3`), so they always land in the same split.
    fn problem_key(&self, problem: &Problem) -> String {
        problem.prompt.clone()
    }

    /// Fraction of the problem space held out for evaluation, in per-mille.
    fn heldout_per_mille(&self) -> u32 {
        100
    }
}

/// Difficulty knobs and reward options shared by the built-in tasks. `None` takes the task's
/// default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskOptions {
    /// `add`/`mul`: most digits per operand (default 3 for `add`, 2 for `mul`).
    pub digits: Option<u32>,
    /// `countdown`: how many numbers are given (default 4).
    pub numbers: Option<usize>,
    /// Penalty for a malformed response (default 0).
    pub format_penalty: Option<f32>,
    /// Held-out fraction in per-mille (default 100 = 10%).
    pub heldout_per_mille: Option<u32>,
    /// `add`/`mul`: write answers least-significant digit first (default false).
    pub reverse: Option<bool>,
    /// `add`/`mul`: draw both operands uniformly in `0..10^digits` instead of the digit count
    /// first (default false).
    pub uniform_operands: Option<bool>,
}

/// Names accepted by [`task_by_name`].
pub const TASK_NAMES: [&str; 3] = ["add", "mul", "countdown"];

/// Builds a built-in task by name.
///
/// ```
/// use rolloutpipe_harness::tasks::{task_by_name, TaskOptions};
/// let err = task_by_name("sub", &TaskOptions::default()).err().unwrap();
/// assert!(err.to_string().contains("add, mul, countdown"));
/// ```
pub fn task_by_name(name: &str, opts: &TaskOptions) -> Result<Box<dyn Task>, TaskError> {
    let penalty = opts.format_penalty.unwrap_or(0.0);
    if !penalty.is_finite() || penalty < 0.0 {
        return Err(TaskError::BadOption {
            option: "format_penalty",
            reason: format!("{penalty} (must be finite and >= 0)"),
        });
    }
    let heldout = opts.heldout_per_mille.unwrap_or(100);
    let reverse = opts.reverse.unwrap_or(false);
    let uniform = opts.uniform_operands.unwrap_or(false);
    if reverse && name == "countdown" {
        return Err(TaskError::BadOption {
            option: "reverse",
            reason: "countdown answers are expressions, not numbers".into(),
        });
    }
    if heldout > 1000 {
        return Err(TaskError::BadOption {
            option: "heldout_per_mille",
            reason: format!("{heldout} (must be at most 1000)"),
        });
    }
    Ok(match name {
        "add" => Box::new(
            AddTask::new(opts.digits.unwrap_or(3), penalty, heldout)?
                .reversed(reverse)
                .uniform_operands(uniform),
        ),
        "mul" => Box::new(
            MulTask::new(opts.digits.unwrap_or(2), penalty, heldout)?
                .reversed(reverse)
                .uniform_operands(uniform),
        ),
        "countdown" => Box::new(CountdownTask::new(
            opts.numbers.unwrap_or(4),
            penalty,
            heldout,
        )?),
        _ => {
            return Err(TaskError::UnknownTask {
                name: name.to_owned(),
            });
        }
    })
}

/// Draws `n` problems of one split, deterministically from `seed`. A problem belongs to the
/// split [`split_of`] assigns to its key, so train and held-out problems never overlap.
pub fn generate(
    task: &dyn Task,
    seed: u64,
    split: Split,
    n: usize,
) -> Result<Vec<Problem>, TaskError> {
    use rand::SeedableRng;
    // Each split gets its own stream so that asking for more training problems never changes
    // the held-out set drawn with the same seed.
    let stream = match split {
        Split::Train => 0,
        Split::HeldOut => 1,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    let per_mille = task.heldout_per_mille();
    let mut out = Vec::with_capacity(n);
    // A split holding at least 1/1000 of the space is hit within 1e5 draws with overwhelming
    // probability; past that the split is empty or degenerate and we say so.
    let limit = 100_000 + 1_000 * n as u64;
    let mut draws = 0u64;
    while out.len() < n {
        if draws >= limit {
            return Err(TaskError::EmptySplit { split, draws });
        }
        draws += 1;
        let p = task.sample(&mut rng);
        if split_of(&task.problem_key(&p), per_mille) == split {
            out.push(p);
        }
    }
    Ok(out)
}

/// The independent test set of a built-in arithmetic task (`add`, `mul`): both operands uniform
/// in `0..10^digits` from `seed`, not filtered by the held-out split, with a one-line description
/// of that distribution for reports. `None` for tasks without one (`countdown`).
pub fn uniform_test_set(
    task: &str,
    digits: u32,
    reverse: bool,
    seed: u64,
    n: usize,
) -> Result<Option<(Vec<Problem>, String)>, TaskError> {
    let op = match task {
        "add" => '+',
        "mul" => '*',
        _ => return Ok(None),
    };
    let problems = uniform_problems(op, digits, reverse, seed, n)?;
    let max = 10u128.pow(digits) - 1;
    Ok(Some((
        problems,
        format!(
            "uniform: {n} problems a{op}b with a, b uniform in 0..={max}, seed {seed} (stream 2), not filtered by the held-out split{}",
            if reverse {
                ", answers least-significant digit first"
            } else {
                ""
            }
        ),
    )))
}
