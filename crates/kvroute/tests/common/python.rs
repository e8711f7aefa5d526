//! Tests that drive a Python library (the official `openai` client, a pyzmq publisher): whether
//! `python3` imports the modules they need. Under `CI=true` a missing module fails the test (CI
//! installs them, `.ci/run`), so a green CI run never hides a skipped test; elsewhere the test
//! is skipped with a line saying how to install them. Shared like `wait.rs`.
#![allow(dead_code)]

use std::process::{Command, Stdio};

/// Whether `python3` imports every one of `modules` (`pip` names the packages to install).
/// Under `CI=true` a missing one fails the test instead of returning false.
pub fn python_has(modules: &[&str], pip: &str) -> bool {
    let ok = Command::new("python3")
        .args(["-c", &format!("import {}", modules.join(", "))])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let what = format!("python3 cannot import {}", modules.join(", "));
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{what}, and CI=true forbids skipping: pip install {pip} (.ci/run does)");
        }
        eprintln!("SKIPPED: {what}; to run this test: pip install {pip}");
    }
    ok
}
