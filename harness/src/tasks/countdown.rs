//! Countdown: reach a target with some of the given numbers, each used at most once, with
//! `+ - * /` and parentheses. Prompts read `"3 7 25 50>123:"` (numbers, `>`, target, `:`).
//! Any correct expression counts, e.g. `(25-7)*3+50+19` is wrong only because 19 is not given.
//!
//! The verifier parses the response with a small recursive-descent parser (depth- and
//! length-limited, so garbage cannot panic it or blow the stack) and evaluates it in exact,
//! overflow-checked integer arithmetic. As in the game, every division must be exact: `7/2` is
//! rejected rather than rounded, which also makes rationals unnecessary. Negative intermediate
//! values are allowed (the target is what is checked). An optional `=N` suffix is accepted when
//! `N` is the target.

use rand::RngExt;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use super::{Problem, Task, TaskError, Verdict, Verifier};

/// Given numbers are drawn from `1..=MAX_NUMBER`.
const MAX_NUMBER: i64 = 25;
/// Generated targets lie in `1..=MAX_TARGET` (three digits keeps answers short).
const MAX_TARGET: i64 = 999;
/// Deepest parenthesis nesting the parser follows before calling the input malformed.
const MAX_DEPTH: usize = 32;
/// Longest number literal; 18 digits fit i64, and products stay checked in i128.
const MAX_LITERAL_DIGITS: usize = 18;

/// Why an expression could not be evaluated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExprError {
    /// Not an expression (unexpected character, unbalanced parentheses, too deep, ...).
    Syntax(String),
    /// Well formed, but not a legal Countdown computation (inexact division, overflow, ...).
    Arith(String),
}

/// Evaluates a Countdown expression exactly. Returns its value and the number literals it
/// uses, in order.
///
/// ```
/// use rolloutpipe_harness::tasks::eval_countdown_expr;
/// assert_eq!(eval_countdown_expr("(25-7)*3 + 50").unwrap(), (104, vec![25, 7, 3, 50]));
/// assert!(eval_countdown_expr("7/2").is_err()); // division must be exact
/// assert!(eval_countdown_expr("((3)").is_err());
/// ```
pub fn eval_countdown_expr(expr: &str) -> Result<(i128, Vec<i128>), ExprError> {
    let mut p = Parser {
        s: expr.as_bytes(),
        pos: 0,
        used: Vec::new(),
    };
    let v = p.expr(0)?;
    p.skip_ws();
    if p.pos != p.s.len() {
        return Err(p.unexpected());
    }
    Ok((v, p.used))
}

struct Parser<'a> {
    s: &'a [u8],
    pos: usize,
    used: Vec<i128>,
}

impl Parser<'_> {
    fn skip_ws(&mut self) {
        while self.pos < self.s.len() && self.s[self.pos].is_ascii_whitespace() {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.s.get(self.pos).copied()
    }

    fn unexpected(&self) -> ExprError {
        match self.s.get(self.pos) {
            None => ExprError::Syntax("unexpected end of expression".into()),
            Some(_) => {
                // Report the character, not the byte, so multi-byte garbage reads sensibly.
                let rest = String::from_utf8_lossy(&self.s[self.pos..]);
                let c = rest.chars().next().unwrap_or('?');
                ExprError::Syntax(format!("unexpected {c:?} at byte {}", self.pos))
            }
        }
    }

    fn expr(&mut self, depth: usize) -> Result<i128, ExprError> {
        let mut acc = self.term(depth)?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.pos += 1;
            let rhs = self.term(depth)?;
            acc = if op == b'+' {
                acc.checked_add(rhs)
            } else {
                acc.checked_sub(rhs)
            }
            .ok_or_else(|| ExprError::Arith("overflow".into()))?;
        }
        Ok(acc)
    }

    fn term(&mut self, depth: usize) -> Result<i128, ExprError> {
        let mut acc = self.factor(depth)?;
        while let Some(op @ (b'*' | b'/')) = self.peek() {
            self.pos += 1;
            let rhs = self.factor(depth)?;
            acc = if op == b'*' {
                acc.checked_mul(rhs)
                    .ok_or_else(|| ExprError::Arith("overflow".into()))?
            } else if rhs == 0 {
                return Err(ExprError::Arith("division by zero".into()));
            } else if acc % rhs != 0 {
                return Err(ExprError::Arith(format!("{acc}/{rhs} is not exact")));
            } else {
                acc / rhs
            };
        }
        Ok(acc)
    }

    fn factor(&mut self, depth: usize) -> Result<i128, ExprError> {
        match self.peek() {
            Some(b'(') => {
                if depth >= MAX_DEPTH {
                    return Err(ExprError::Syntax(format!(
                        "parentheses nested deeper than {MAX_DEPTH}"
                    )));
                }
                self.pos += 1;
                let v = self.expr(depth + 1)?;
                if self.peek() != Some(b')') {
                    return Err(self.unexpected());
                }
                self.pos += 1;
                Ok(v)
            }
            Some(b'0'..=b'9') => {
                let start = self.pos;
                while self.pos < self.s.len() && self.s[self.pos].is_ascii_digit() {
                    self.pos += 1;
                }
                if self.pos - start > MAX_LITERAL_DIGITS {
                    return Err(ExprError::Syntax("number literal too long".into()));
                }
                let mut v: i128 = 0;
                for &b in &self.s[start..self.pos] {
                    v = v * 10 + i128::from(b - b'0');
                }
                self.used.push(v);
                Ok(v)
            }
            _ => Err(self.unexpected()),
        }
    }
}

/// Numbers and target of a Countdown problem: from `meta` when it has them, else parsed from a
/// prompt of the built-in shape `"3 7 25 50>123:"`.
pub(crate) fn numbers_and_target(problem: &Problem) -> Result<(Vec<i128>, i128), TaskError> {
    if let (Some(nums), Some(target)) = (problem.meta.get("numbers"), problem.meta.get("target")) {
        let nums: Option<Vec<i128>> = nums
            .as_array()
            .map(|a| a.iter().map(|v| v.as_i64().map(i128::from)).collect())
            .unwrap_or(None);
        return match (nums, target.as_i64()) {
            (Some(nums), Some(t)) => Ok((nums, i128::from(t))),
            _ => Err(TaskError::BadProblem(
                "countdown meta must be {\"numbers\": [integers], \"target\": integer}".into(),
            )),
        };
    }
    let bad = || {
        TaskError::BadProblem(format!(
            "countdown prompt {:?} is not of the form \"3 7 25 50>123:\" and meta has no numbers/target",
            problem.prompt
        ))
    };
    let body = problem.prompt.trim().strip_suffix(':').ok_or_else(bad)?;
    let (nums, target) = body.split_once('>').ok_or_else(bad)?;
    let nums: Vec<i128> = nums
        .split_whitespace()
        .map(|n| n.parse::<i64>().map(i128::from))
        .collect::<Result<_, _>>()
        .map_err(|_| bad())?;
    let target = target.trim().parse::<i64>().map_err(|_| bad())?;
    if nums.is_empty() {
        return Err(bad());
    }
    Ok((nums, i128::from(target)))
}

/// Checks a response against numbers and target.
fn verify_expr(nums: &[i128], target: i128, response: &str) -> Verdict {
    let response = response.trim();
    // An optional "= target" suffix: the model may state the result it claims.
    let (expr, claimed) = match response.split_once('=') {
        Some((e, c)) => match c.trim().parse::<i128>() {
            Ok(c) => (e, Some(c)),
            Err(_) => {
                return Verdict::Malformed(format!("{:?} after '=' is not a number", c.trim()));
            }
        },
        None => (response, None),
    };
    let (value, used) = match eval_countdown_expr(expr) {
        Ok(v) => v,
        Err(ExprError::Syntax(e)) => return Verdict::Malformed(e),
        Err(ExprError::Arith(e)) => return Verdict::Incorrect(e),
    };
    let mut avail = nums.to_vec();
    for u in &used {
        match avail.iter().position(|a| a == u) {
            Some(i) => {
                avail.swap_remove(i);
            }
            None => {
                return Verdict::Incorrect(format!(
                    "{u} is not available (given {nums:?}, each at most once)"
                ));
            }
        }
    }
    if let Some(c) = claimed
        && c != value
    {
        return Verdict::Incorrect(format!("expression is {value}, not the claimed {c}"));
    }
    if value == target {
        Verdict::Correct
    } else {
        Verdict::Incorrect(format!("expression is {value}, target {target}"))
    }
}

/// The Countdown task with `numbers` given numbers.
#[derive(Debug, Clone)]
pub struct CountdownTask {
    numbers: usize,
    format_penalty: f32,
    heldout_per_mille: u32,
}

impl CountdownTask {
    /// A task giving `numbers` numbers (2..=6).
    pub fn new(
        numbers: usize,
        format_penalty: f32,
        heldout_per_mille: u32,
    ) -> Result<Self, TaskError> {
        if !(2..=6).contains(&numbers) {
            return Err(TaskError::BadOption {
                option: "numbers",
                reason: format!("{numbers} (must be 2..=6)"),
            });
        }
        Ok(Self {
            numbers,
            format_penalty,
            heldout_per_mille,
        })
    }

    /// The problem with these numbers, target and a known solution.
    pub fn problem(numbers: &[i64], target: i64, solution: String) -> Problem {
        let nums: Vec<String> = numbers.iter().map(i64::to_string).collect();
        Problem {
            prompt: format!("{}>{target}:", nums.join(" ")),
            answer: solution,
            meta: json!({ "numbers": numbers, "target": target }),
        }
    }

    /// Combines a random subset of `nums` into a random expression; `None` when this draw gave
    /// no usable target (the caller draws again).
    fn try_build(rng: &mut ChaCha8Rng, nums: &[i64]) -> Option<(i64, String)> {
        let mut order: Vec<usize> = (0..nums.len()).collect();
        order.shuffle(rng);
        let k = rng.random_range(2..=nums.len());
        // Items are (value, expression, precedence of its top operator: 3 for a number, 2 for
        // `*` `/`, 1 for `+` `-`). Parentheses go only where precedence needs them, so SFT
        // targets are as short as a person would write them.
        let mut items: Vec<(i64, String, u8)> = order[..k]
            .iter()
            .map(|&i| (nums[i], nums[i].to_string(), 3))
            .collect();
        while items.len() > 1 {
            let a = items.swap_remove(rng.random_range(0..items.len()));
            let b = items.swap_remove(rng.random_range(0..items.len()));
            let (a, b) = if a.0 >= b.0 { (a, b) } else { (b, a) };
            // Keep values positive and modest, divisions exact: the solutions stay readable.
            let mut ops = vec!['+'];
            if a.0 > b.0 {
                ops.push('-');
            }
            if a.0 * b.0 <= 10 * MAX_TARGET && a.0 > 1 && b.0 > 1 {
                ops.push('*');
            }
            if b.0 > 1 && a.0 % b.0 == 0 {
                ops.push('/');
            }
            let op = ops[rng.random_range(0..ops.len())];
            let (v, prec) = match op {
                '+' => (a.0 + b.0, 1),
                '-' => (a.0 - b.0, 1),
                '*' => (a.0 * b.0, 2),
                _ => (a.0 / b.0, 2),
            };
            // The left operand needs parentheses below the operator's precedence; the right one
            // also at equal precedence under `-` and `/` (a-(b+c), a/(b*c)).
            let paren = |e: &(i64, String, u8), strict: bool| {
                if e.2 < prec || (strict && e.2 == prec) {
                    format!("({})", e.1)
                } else {
                    e.1.clone()
                }
            };
            let expr = format!(
                "{}{op}{}",
                paren(&a, false),
                paren(&b, op == '-' || op == '/')
            );
            items.push((v, expr, prec));
        }
        let (v, e, _) = items.pop()?;
        (1..=MAX_TARGET)
            .contains(&v)
            .then_some(())
            .filter(|_| !nums.contains(&v))
            .map(|_| (v, e))
    }
}

impl Verifier for CountdownTask {
    fn verify(&self, problem: &Problem, response: &str) -> Verdict {
        match numbers_and_target(problem) {
            Ok((nums, target)) => verify_expr(&nums, target, response),
            Err(e) => Verdict::Malformed(e.to_string()),
        }
    }
    fn format_penalty(&self) -> f32 {
        self.format_penalty
    }
    fn check_problem(&self, problem: &Problem) -> Result<(), TaskError> {
        numbers_and_target(problem).map(|_| ())
    }
}

impl Task for CountdownTask {
    fn name(&self) -> &str {
        "countdown"
    }
    fn sample(&self, rng: &mut ChaCha8Rng) -> Problem {
        loop {
            let nums: Vec<i64> = (0..self.numbers)
                .map(|_| rng.random_range(1..=MAX_NUMBER))
                .collect();
            // Most draws succeed; a few give a target outside the range or equal to a given
            // number (trivial), so draw again.
            for _ in 0..16 {
                if let Some((target, expr)) = Self::try_build(rng, &nums) {
                    return Self::problem(&nums, target, expr);
                }
            }
        }
    }
    fn problem_key(&self, problem: &Problem) -> String {
        match numbers_and_target(problem) {
            Ok((mut nums, target)) => {
                nums.sort_unstable();
                format!("{nums:?}>{target}")
            }
            Err(_) => problem.prompt.clone(),
        }
    }
    fn heldout_per_mille(&self) -> u32 {
        self.heldout_per_mille
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::{Split, generate};
    use proptest::prelude::*;

    fn task() -> CountdownTask {
        CountdownTask::new(4, 0.0, 100).unwrap()
    }

    #[test]
    fn examples() {
        let p = CountdownTask::problem(&[3, 7, 25, 50], 104, "(25-7)*3+50".into());
        let t = task();
        for ok in [
            "(25-7)*3+50",
            " 50 + 3*(25 - 7) ",
            "(25-7)*3+50=104",
            "((50))+(25-7)*3",
            "3*(25-7)+50 = 104",
        ] {
            assert_eq!(t.verify(&p, ok), Verdict::Correct, "{ok}");
        }
        let wrong = [
            ("(25-7)*3+50=105", "claimed"),
            ("25*3+50", "target"),
            ("(25-7)*3+50+3", "not available"),
            ("50/3", "not exact"),
            ("50/(7-7)", "division by zero"),
            ("7+7+25+50+3+12", "not available"),
        ];
        for (resp, why) in wrong {
            match t.verify(&p, resp) {
                Verdict::Incorrect(r) => assert!(r.contains(why), "{resp}: {r}"),
                v => panic!("{resp}: {v:?}"),
            }
        }
        for bad in [
            "",
            "(",
            "25-",
            "25 7",
            "2a",
            "-3+107",
            "((((((((((((((((((((((((((((((((((3))))))))))))))))))))))))))))))))))",
            "104=x",
        ] {
            assert!(
                matches!(t.verify(&p, bad), Verdict::Malformed(_)),
                "{bad:?}"
            );
        }
        let q = CountdownTask::problem(&[4, 0, 5], 5, "5".into());
        assert!(
            matches!(t.verify(&q, "5+4/0"), Verdict::Incorrect(r) if r.contains("division by zero"))
        );
    }

    #[test]
    fn prompt_parses_without_meta() {
        let mut p = CountdownTask::problem(&[3, 7], 21, "3*7".into());
        p.meta = serde_json::Value::Null;
        assert_eq!(numbers_and_target(&p).unwrap(), (vec![3, 7], 21));
        assert_eq!(task().verify(&p, "7*3"), Verdict::Correct);
        p.prompt = "make 21".into();
        assert!(task().check_problem(&p).is_err());
    }

    #[test]
    fn generated_answers_verify_and_are_deterministic() {
        let t = task();
        let a = generate(&t, 5, Split::Train, 200).unwrap();
        assert_eq!(a, generate(&t, 5, Split::Train, 200).unwrap());
        for p in &a {
            assert_eq!(t.verify(p, &p.answer), Verdict::Correct, "{p:?}");
            let (nums, target) = numbers_and_target(p).unwrap();
            assert_eq!(nums.len(), 4);
            assert!((1..=MAX_TARGET as i128).contains(&target));
        }
        let held = generate(&t, 5, Split::HeldOut, 200).unwrap();
        let train_keys: std::collections::HashSet<_> = a.iter().map(|p| t.problem_key(p)).collect();
        assert!(held.iter().all(|p| !train_keys.contains(&t.problem_key(p))));
    }

    proptest! {
        #[test]
        fn garbage_never_panics(s in "[0-9+*/() =a-]{0,40}|\\PC{0,40}") {
            let p = CountdownTask::problem(&[3, 7, 25, 50], 104, "(25-7)*3+50".into());
            let _ = task().verify(&p, &s);
        }

        #[test]
        fn any_permutation_of_a_sum_verifies(mut nums in prop::collection::vec(1i64..100, 2..6), seed in any::<u64>()) {
            use rand::SeedableRng;
            let target: i64 = nums.iter().sum();
            let p = CountdownTask::problem(&nums, target, String::new());
            nums.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
            let expr: Vec<String> = nums.iter().map(i64::to_string).collect();
            prop_assert_eq!(task().verify(&p, &expr.join(" + ")), Verdict::Correct);
            // Using one number twice is never allowed.
            let dup = format!("{}+{}-{}", expr.join("+"), nums[0], nums[0]);
            prop_assert!(matches!(task().verify(&p, &dup), Verdict::Incorrect(_)));
        }

        #[test]
        fn evaluation_matches_i128_reference(a in 1i64..1000, b in 1i64..1000, c in 1i64..1000) {
            let (v, used) = eval_countdown_expr(&format!("{a}*({b}+{c})-{c}")).unwrap();
            prop_assert_eq!(v, i128::from(a) * i128::from(b + c) - i128::from(c));
            prop_assert_eq!(used, vec![a as i128, b as i128, c as i128, c as i128]);
            let div = eval_countdown_expr(&format!("{}/{b}", a * b)).unwrap().0;
            prop_assert_eq!(div, i128::from(a));
        }
    }
}
