//! Multi-digit addition and multiplication. Prompts read `"{a}+{b}="` / `"{a}*{b}="`; the answer
//! is the exact decimal result. A response is correct when, trimmed of surrounding whitespace, it
//! is that integer (leading zeros allowed); anything that is not a decimal integer is malformed.
//! Operands have 1 to `digits` digits (the digit count is drawn uniformly, then the value), so
//! short and long problems are equally common.
//!
//! With `reverse`, answers are written least-significant digit first (`"12+39="` → `"15"` for
//! 51): each answer digit then depends only on the operand digits of its column and the carry
//! from the digit just written, a rule a small model can learn once and apply everywhere, where
//! the usual order makes it resolve every carry before writing the first digit.

use rand::RngExt;
use rand_chacha::ChaCha8Rng;

use super::{Problem, Task, TaskError, Verdict, Verifier};

/// Largest operand width: two 19-digit operands multiply to under 10^38 < u128::MAX.
const MAX_DIGITS: u32 = 19;

/// Canonical form of a decimal integer (optional `-`, digits; leading zeros and `-0` folded),
/// or `None` when `s` is not one. Works on strings so answers of any size compare exactly.
fn canonical_int(s: &str) -> Option<String> {
    let s = s.trim();
    let (neg, digits) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let stripped = digits.trim_start_matches('0');
    Some(match (neg, stripped.is_empty()) {
        (_, true) => "0".to_owned(),
        (true, false) => format!("-{stripped}"),
        (false, false) => stripped.to_owned(),
    })
}

fn reversed(s: &str) -> String {
    s.chars().rev().collect()
}

/// Verifies an answer written least-significant digit first: both read back in the usual order.
fn verify_reversed(problem: &Problem, response: &str) -> Verdict {
    let usual = Problem {
        answer: reversed(problem.answer.trim()),
        ..problem.clone()
    };
    verify_int(&usual, &reversed(response.trim()))
}

/// Verifies an integer answer: shared by `add` and `mul` (and usable for any integer task).
fn verify_int(problem: &Problem, response: &str) -> Verdict {
    let Some(expected) = canonical_int(&problem.answer) else {
        return Verdict::Malformed(format!(
            "problem answer {:?} is not an integer",
            problem.answer
        ));
    };
    match canonical_int(response) {
        None => Verdict::Malformed(format!("response {response:?} is not a decimal integer")),
        Some(got) if got == expected => Verdict::Correct,
        Some(got) => Verdict::Incorrect(format!("got {got}, expected {expected}")),
    }
}

fn check_int_problem(problem: &Problem) -> Result<(), TaskError> {
    match canonical_int(&problem.answer) {
        Some(_) => Ok(()),
        None => Err(TaskError::BadProblem(format!(
            "answer {:?} is not a decimal integer",
            problem.answer
        ))),
    }
}

fn check_digits(digits: u32) -> Result<u32, TaskError> {
    if (1..=MAX_DIGITS).contains(&digits) {
        Ok(digits)
    } else {
        Err(TaskError::BadOption {
            option: "digits",
            reason: format!("{digits} (must be 1..={MAX_DIGITS})"),
        })
    }
}

/// Draws an operand: digit count uniform in 1..=digits, then the value uniform among numbers
/// of exactly that many digits (0 counts as a 1-digit number).
fn operand(rng: &mut ChaCha8Rng, digits: u32) -> u128 {
    let d = rng.random_range(1..=digits);
    let lo = if d == 1 { 0 } else { 10u128.pow(d - 1) };
    rng.random_range(lo..10u128.pow(d))
}

/// The independent test distribution of `add`/`mul`: both operands uniform in
/// `0..10^digits` (so 90% of 2-digit operands have two digits, unlike the training generator's
/// 50%), drawn from `seed` on a stream (2) that neither split's generator uses, and *not* filtered
/// by the held-out split: the set is independent of the training generator and of its split.
pub fn uniform_problems(
    op: char,
    digits: u32,
    reverse: bool,
    seed: u64,
    n: usize,
) -> Result<Vec<Problem>, TaskError> {
    use rand::SeedableRng;
    let digits = check_digits(digits)?;
    let apply: fn(u128, u128) -> u128 = match op {
        '+' => |a, b| a + b,
        '*' => |a, b| a * b,
        _ => {
            return Err(TaskError::BadOption {
                option: "op",
                reason: format!("{op:?} (uniform test sets exist for + and *)"),
            });
        }
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(2);
    let top = 10u128.pow(digits);
    Ok((0..n)
        .map(|_| {
            let a = rng.random_range(0..top);
            let b = rng.random_range(0..top);
            let answer = apply(a, b).to_string();
            Problem {
                prompt: format!("{a}{op}{b}="),
                answer: if reverse { reversed(&answer) } else { answer },
                meta: serde_json::Value::Null,
            }
        })
        .collect())
}

/// Key that makes `a op b` and `b op a` the same problem.
fn commutative_key(a: u128, b: u128, op: char) -> String {
    let (x, y) = if a <= b { (a, b) } else { (b, a) };
    format!("{x}{op}{y}")
}

/// Operands of a prompt `"{a}{op}{b}="`, if it has that shape.
pub(crate) fn parse_operands(prompt: &str, op: char) -> Option<(u128, u128)> {
    let body = prompt.strip_suffix('=')?;
    let (a, b) = body.split_once(op)?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

macro_rules! arith_task {
    ($name:ident, $task:literal, $op:literal, $apply:expr, $doc:literal) => {
        #[doc = $doc]
        #[derive(Debug, Clone)]
        pub struct $name {
            digits: u32,
            format_penalty: f32,
            heldout_per_mille: u32,
            reverse: bool,
            uniform: bool,
        }

        impl $name {
            /// A task with operands of up to `digits` digits (1..=19).
            pub fn new(
                digits: u32,
                format_penalty: f32,
                heldout_per_mille: u32,
            ) -> Result<Self, TaskError> {
                Ok(Self {
                    digits: check_digits(digits)?,
                    format_penalty,
                    heldout_per_mille,
                    reverse: false,
                    uniform: false,
                })
            }

            /// The same task with both operands drawn uniformly in `0..10^digits` (the
            /// independent test distribution) instead of digit count first.
            pub fn uniform_operands(mut self, uniform: bool) -> Self {
                self.uniform = uniform;
                self
            }

            /// The same task with answers written least-significant digit first.
            pub fn reversed(mut self, reverse: bool) -> Self {
                self.reverse = reverse;
                self
            }

            /// The problem `a op b`.
            pub fn problem(a: u128, b: u128) -> Problem {
                let apply: fn(u128, u128) -> u128 = $apply;
                Problem {
                    prompt: format!("{a}{}{b}=", $op),
                    answer: apply(a, b).to_string(),
                    meta: serde_json::Value::Null,
                }
            }
        }

        impl Verifier for $name {
            fn verify(&self, problem: &Problem, response: &str) -> Verdict {
                if self.reverse {
                    verify_reversed(problem, response)
                } else {
                    verify_int(problem, response)
                }
            }
            fn format_penalty(&self) -> f32 {
                self.format_penalty
            }
            fn check_problem(&self, problem: &Problem) -> Result<(), TaskError> {
                check_int_problem(problem)?;
                // A prompt in the task's own `a op b=` form can be checked: its answer must be
                // the true result, or training would reward wrong arithmetic.
                if let Some((a, b)) = parse_operands(&problem.prompt, $op) {
                    let truth = match $op {
                        '+' => a.checked_add(b),
                        _ => a.checked_mul(b),
                    };
                    let given = canonical_int(&problem.answer);
                    if truth.map(|t| t.to_string()) != given {
                        return Err(TaskError::BadProblem(format!(
                            "answer {:?} is wrong: {a}{}{b} = {}",
                            problem.answer,
                            $op,
                            truth.map_or("(too large)".to_owned(), |t| t.to_string())
                        )));
                    }
                }
                Ok(())
            }
        }

        impl Task for $name {
            fn name(&self) -> &str {
                $task
            }
            fn sample(&self, rng: &mut ChaCha8Rng) -> Problem {
                let (a, b) = if self.uniform {
                    let top = 10u128.pow(self.digits);
                    (rng.random_range(0..top), rng.random_range(0..top))
                } else {
                    (operand(rng, self.digits), operand(rng, self.digits))
                };
                let mut p = Self::problem(a, b);
                if self.reverse {
                    p.answer = reversed(&p.answer);
                }
                p
            }
            fn problem_key(&self, problem: &Problem) -> String {
                match parse_operands(&problem.prompt, $op) {
                    Some((a, b)) => commutative_key(a, b, $op),
                    None => problem.prompt.clone(),
                }
            }
            fn heldout_per_mille(&self) -> u32 {
                self.heldout_per_mille
            }
        }
    };
}

arith_task!(
    AddTask,
    "add",
    '+',
    |a, b| a + b,
    "Multi-digit addition: `\"123+45=\"` → `\"168\"`."
);
arith_task!(
    MulTask,
    "mul",
    '*',
    |a, b| a * b,
    "Multi-digit multiplication: `\"12*34=\"` → `\"408\"`."
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::{Split, generate, split_of};
    use proptest::prelude::*;

    #[test]
    fn canonical_forms() {
        assert_eq!(canonical_int(" 0042\n").as_deref(), Some("42"));
        assert_eq!(canonical_int("-0").as_deref(), Some("0"));
        assert_eq!(canonical_int("-007").as_deref(), Some("-7"));
        for bad in ["", " ", "-", "+4", "4 2", "4.0", "x", "٣"] {
            assert_eq!(canonical_int(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn generators_are_deterministic_and_correct() {
        let add = AddTask::new(4, 0.0, 100).unwrap();
        let a = generate(&add, 11, Split::Train, 50).unwrap();
        assert_eq!(a, generate(&add, 11, Split::Train, 50).unwrap());
        assert_ne!(a, generate(&add, 12, Split::Train, 50).unwrap());
        for p in &a {
            let (x, y) = parse_operands(&p.prompt, '+').unwrap();
            assert!(x < 10_000 && y < 10_000);
            assert_eq!(p.answer, (x + y).to_string());
        }
        let mul = MulTask::new(19, 0.0, 100).unwrap();
        for p in generate(&mul, 3, Split::HeldOut, 50).unwrap() {
            let (x, y) = parse_operands(&p.prompt, '*').unwrap();
            assert_eq!(p.answer, (x * y).to_string());
        }
    }

    #[test]
    fn heldout_is_disjoint_from_train_even_when_space_is_small() {
        // 1-digit addition has only 55 distinct problems, so both splits are drawn many times
        // over: a leak would show.
        let add = AddTask::new(1, 0.0, 300).unwrap();
        let train = generate(&add, 1, Split::Train, 2_000).unwrap();
        let held = generate(&add, 1, Split::HeldOut, 500).unwrap();
        let train_keys: std::collections::HashSet<_> =
            train.iter().map(|p| add.problem_key(p)).collect();
        let held_keys: std::collections::HashSet<_> =
            held.iter().map(|p| add.problem_key(p)).collect();
        assert!(train_keys.is_disjoint(&held_keys));
        assert!(held_keys.len() > 5 && train_keys.len() > 20);
        // Commuted problems share a key, hence a split.
        let p = AddTask::problem(3, 4);
        let q = AddTask::problem(4, 3);
        assert_eq!(
            split_of(&add.problem_key(&p), 300),
            split_of(&add.problem_key(&q), 300)
        );
    }

    #[test]
    fn uniform_test_set_covers_the_square_and_is_seeded() {
        let a = uniform_problems('+', 2, false, 20_261_201, 1000).unwrap();
        assert_eq!(
            a,
            uniform_problems('+', 2, false, 20_261_201, 1000).unwrap()
        );
        assert_ne!(a, uniform_problems('+', 2, false, 7, 1000).unwrap());
        let r = uniform_problems('+', 2, true, 20_261_201, 1000).unwrap();
        assert_eq!(r[0].prompt, a[0].prompt);
        assert_eq!(r[0].answer, a[0].answer.chars().rev().collect::<String>());
        let mut two_digit = 0;
        for p in &a {
            let (x, y) = parse_operands(&p.prompt, '+').unwrap();
            assert!(x < 100 && y < 100);
            assert_eq!(p.answer, (x + y).to_string());
            two_digit += usize::from(x >= 10) + usize::from(y >= 10);
        }
        // 90% of uniform operands have two digits (the training generator: 50%).
        assert!((1_720..1_880).contains(&two_digit), "{two_digit} of 2000");
        assert!(uniform_problems('-', 2, false, 0, 1).is_err());
        assert!(uniform_problems('*', 0, false, 0, 1).is_err());
    }

    #[test]
    fn reversed_answers_are_generated_and_verified_least_significant_digit_first() {
        let add = AddTask::new(2, 0.0, 100).unwrap().reversed(true);
        let p = Problem {
            answer: "15".into(),
            ..AddTask::problem(12, 39)
        };
        assert_eq!(add.verify(&p, "15"), Verdict::Correct);
        assert_eq!(add.verify(&p, " 150\n"), Verdict::Correct); // 051 = 51
        assert!(matches!(add.verify(&p, "51"), Verdict::Incorrect(_)));
        assert!(matches!(add.verify(&p, "x"), Verdict::Malformed(_)));
        for q in generate(&add, 5, Split::Train, 50).unwrap() {
            let (x, y) = parse_operands(&q.prompt, '+').unwrap();
            let want: String = (x + y).to_string().chars().rev().collect();
            assert_eq!(q.answer, want);
            assert_eq!(add.verify(&q, &q.answer), Verdict::Correct);
        }
        let uni = AddTask::new(2, 0.0, 100).unwrap().uniform_operands(true);
        let two = generate(&uni, 5, Split::Train, 1000)
            .unwrap()
            .iter()
            .map(|q| parse_operands(&q.prompt, '+').unwrap())
            .filter(|&(x, y)| x >= 10 && y >= 10)
            .count();
        assert!(
            (760..860).contains(&two),
            "{two} of 1000 with two 2-digit operands"
        );
        let mul = MulTask::new(2, 0.0, 100).unwrap().reversed(true);
        let q = Problem {
            answer: "804".into(),
            ..MulTask::problem(12, 34)
        };
        assert_eq!(mul.verify(&q, "804"), Verdict::Correct);
    }

    #[test]
    fn bad_digits_rejected() {
        assert!(AddTask::new(0, 0.0, 100).is_err());
        assert!(MulTask::new(20, 0.0, 100).is_err());
    }

    #[test]
    fn format_penalty_applies_to_malformed_only() {
        let add = AddTask::new(2, 0.5, 100).unwrap();
        let p = AddTask::problem(12, 30);
        assert_eq!(add.reward(&p, "42"), 1.0);
        assert_eq!(add.reward(&p, "43"), 0.0);
        assert_eq!(add.reward(&p, "forty-two"), -0.5);
    }

    proptest! {
        #[test]
        fn add_accepts_every_correct_form(a in 0u128..10u128.pow(18), b in 0u128..10u128.pow(18),
                                          zeros in 0usize..4, pre in "[ \t\n]{0,3}", post in "[ \t\n]{0,3}") {
            let task = AddTask::new(18, 0.0, 100).unwrap();
            let p = AddTask::problem(a, b);
            let resp = format!("{pre}{}{}{post}", "0".repeat(zeros), a + b);
            prop_assert_eq!(task.verify(&p, &resp), Verdict::Correct);
        }

        #[test]
        fn mul_rejects_every_wrong_number(a in 0u128..10u128.pow(9), b in 0u128..10u128.pow(9), delta in 1u128..1000) {
            let task = MulTask::new(9, 0.0, 100).unwrap();
            let p = MulTask::problem(a, b);
            prop_assert_eq!(task.verify(&p, &(a * b).to_string()), Verdict::Correct);
            prop_assert!(matches!(task.verify(&p, &(a * b + delta).to_string()), Verdict::Incorrect(_)));
            if a * b >= delta {
                prop_assert!(matches!(task.verify(&p, &(a * b - delta).to_string()), Verdict::Incorrect(_)));
            }
        }

        #[test]
        fn garbage_never_verifies_and_never_panics(s in "\\PC{0,20}") {
            let task = AddTask::new(3, 0.0, 100).unwrap();
            let p = AddTask::problem(12, 30);
            let v = task.verify(&p, &s);
            prop_assert_eq!(v.is_correct(), canonical_int(&s).as_deref() == Some("42"));
        }
    }
}
