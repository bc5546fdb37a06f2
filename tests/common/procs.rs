//! `kvbench` child processes for the multi-process tests: spawned with their output in files, polled
//! with deadlines, killed and reaped on drop so a failing test leaves no process behind.
// Each test file uses the part it needs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Children killed and reaped on drop, so a failing test leaves no process behind.
pub struct Children {
    pub procs: Vec<(String, Child)>,
    pub dir: PathBuf,
    /// The secret every child gets in `KVX_TOKEN`, fresh for each set of children.
    pub token: String,
}

impl Children {
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kvbench-procs-{tag}-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let token = (0..4)
            .map(|_| format!("{:016x}", rand::random::<u64>()))
            .collect();
        Self {
            procs: Vec::new(),
            dir,
            token,
        }
    }

    /// Spawns `prefix.. kvbench args..` (prefix: for instance `ip netns exec NS`, which execs, so the
    /// child's pid is kvbench's) with `KVBENCH_LOG=info`, `KVX_TOKEN` set to [`Self::token`], and
    /// then `envs` added.
    pub fn spawn(&mut self, name: &str, prefix: &[&str], args: &[String], envs: &[(&str, &str)]) {
        let out = std::fs::File::create(self.dir.join(format!("{name}.out"))).unwrap();
        let err = std::fs::File::create(self.dir.join(format!("{name}.err"))).unwrap();
        let bin = env!("CARGO_BIN_EXE_kvbench");
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        // KVBENCH_LOG and KVX_TOKEN first, so that `envs` may override them.
        cmd.args(args)
            .env("KVBENCH_LOG", "info")
            .env("KVX_TOKEN", &self.token)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child = cmd.spawn().unwrap();
        self.procs.push((name.into(), child));
    }

    /// Polls child `i` until it exits or `deadline` passes; `None` at the deadline.
    pub fn wait(&mut self, i: usize, deadline: Instant) -> Option<ExitStatus> {
        loop {
            if let Some(status) = self.procs[i].1.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls until `cond` holds of child `i`'s stderr; false at the deadline or when `i` exits first.
    pub fn wait_stderr(
        &mut self,
        i: usize,
        deadline: Instant,
        cond: impl Fn(&str) -> bool,
    ) -> bool {
        loop {
            if cond(&self.stderr(i)) {
                return true;
            }
            if Instant::now() >= deadline || self.procs[i].1.try_wait().unwrap().is_some() {
                return cond(&self.stderr(i));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn sigkill(&mut self, i: usize) {
        let pid = libc::pid_t::try_from(self.procs[i].1.id()).unwrap();
        // SAFETY: a plain kill(2) of our own, not yet reaped, child.
        let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
        assert_eq!(rc, 0, "kill({pid}, SIGKILL) failed");
    }

    pub fn stderr(&self, i: usize) -> String {
        read(&self.dir.join(format!("{}.err", self.procs[i].0)))
    }

    pub fn stdout(&self, i: usize) -> String {
        read(&self.dir.join(format!("{}.out", self.procs[i].0)))
    }

    /// Every child's stderr, for failure messages.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for (i, (name, _)) in self.procs.iter().enumerate() {
            s += &format!("--- {name} stderr:\n{}\n", self.stderr(i));
        }
        s
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

pub fn strings(s: &[&str]) -> Vec<String> {
    s.iter().map(|s| s.to_string()).collect()
}

/// A log without its terminal color sequences (`ESC [ ... m`), for matching `key=value` fields.
pub fn without_colors(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut it = log.chars();
    while let Some(c) = it.next() {
        if c == '\u{1b}' {
            for d in it.by_ref() {
                if d == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
