//! The README's embedding code is the example's, line for line: the example is built by the
//! tests and run by CI, so the code a newcomer copies from the README compiles and runs.

const README: &str = include_str!("../../README.md");
const EXAMPLE: &str = include_str!("../../runtime-tokio/examples/embed.rs");

#[test]
fn the_readme_embedding_code_is_the_examples_code() {
    let block = README
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("```\n").next())
        .expect("the README has a rust block");
    let from = EXAMPLE
        .find("// [README]")
        .and_then(|at| EXAMPLE[at..].find('\n').map(|n| at + n + 1))
        .expect("the example marks where the README's code starts");
    let to = EXAMPLE.find("    // [/README]").expect("and where it ends");
    let example: String = EXAMPLE[from..to]
        .lines()
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    assert_eq!(
        block, example,
        "README.md's rust block differs from embed.rs"
    );
}
