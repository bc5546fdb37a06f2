//! A local etcd server for `kvbench --etcd auto` and the discovery tests: Debian's `etcd` binary
//! (package `etcd-server`, which `scripts/provision` installs) on two free loopback ports with its
//! own data folder, stopped and its folder removed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd server.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    data: PathBuf,
    client_port: u16,
    peer_port: u16,
    binary: PathBuf,
    log: PathBuf,
    /// With TLS: the server's certificate, its key, and the CA its clients' certificates must
    /// chain to; and the plain-HTTP port its health is read on.
    tls: Option<(Tls, u16)>,
}

/// PEM files of an etcd server that speaks TLS and asks every client for a certificate.
#[derive(Debug, Clone)]
pub struct Tls {
    /// The server's certificate.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
    /// The CA clients' certificates must chain to.
    pub client_ca: PathBuf,
}

/// How long a start may take before it counts as failed.
const START_BOUND: Duration = Duration::from_secs(20);

impl EtcdServer {
    /// Starts `etcd` (`KVX_ETCD`, else `etcd` on the PATH) with a fresh data folder and waits
    /// until it answers.
    ///
    /// # Errors
    /// No binary, no free ports, or no answer within 20 s.
    pub fn start() -> Result<Self, String> {
        Self::start_with(None)
    }

    /// [`start`](Self::start) with TLS on the client port (`https://`), every client asked for a
    /// certificate that chains to `tls.client_ca`.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_tls(tls: Tls) -> Result<Self, String> {
        Self::start_with(Some(tls))
    }

    fn start_with(tls: Option<Tls>) -> Result<Self, String> {
        let binary = std::env::var_os("KVX_ETCD")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("etcd"));
        let ports = crate::cluster::free_addrs(3).map_err(|e| format!("no free ports: {e}"))?;
        let data = std::env::temp_dir().join(format!(
            "kvx-etcd-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
        let mut s = EtcdServer {
            child: None,
            log: data.with_extension("log"),
            data,
            client_port: ports[0].port(),
            peer_port: ports[1].port(),
            binary,
            tls: tls.map(|t| (t, ports[2].port())),
        };
        s.resume()?;
        Ok(s)
    }

    /// The client URL, `http://127.0.0.1:<port>` (`https://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The server process's id, while it runs (for tests that stop it with SIGSTOP).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The data folder (it survives [`stop`](Self::stop), so [`resume`](Self::resume) keeps the
    /// records and leases).
    pub fn data(&self) -> &Path {
        &self.data
    }

    /// Stops the server (SIGKILL), keeping its data.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same ports and data, and waits until it answers.
    ///
    /// # Errors
    /// It does not start or answer within 20 s.
    pub fn resume(&mut self) -> Result<(), String> {
        self.stop();
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("{}: {e}", self.log.display()))?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new(&self.binary)
            .arg("--name")
            .arg("kvx")
            .arg("--data-dir")
            .arg(&self.data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("kvx={peer}")])
            .args(match &self.tls {
                Some((t, metrics)) => vec![
                    "--cert-file".into(),
                    t.cert.clone().into_os_string(),
                    "--key-file".into(),
                    t.key.clone().into_os_string(),
                    "--trusted-ca-file".into(),
                    t.client_ca.clone().into_os_string(),
                    "--client-cert-auth".into(),
                    "--listen-metrics-urls".into(),
                    format!("http://127.0.0.1:{metrics}").into(),
                ],
                None => Vec::new(),
            })
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot start {} (install etcd-server, or set KVX_ETCD): {e}",
                    self.binary.display()
                )
            })?;
        self.child = Some(child);
        let deadline = Instant::now() + START_BOUND;
        // Without TLS the client port answers plain HTTP; with it, the metrics port does.
        let health = format!(
            "127.0.0.1:{}",
            self.tls.as_ref().map_or(self.client_port, |(_, m)| *m)
        );
        loop {
            // etcd answers plain HTTP on its client port: /health says it has a leader.
            if let Ok(body) = http_get(&health, "/health")
                && body.contains("\"health\":\"true\"")
            {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                return Err(format!("etcd exited ({status}):\n{}", self.log()));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "etcd did not answer in {START_BOUND:?}:\n{}",
                    self.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.data);
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A minimal HTTP/1.0 GET of `path` on `addr`, for etcd's health endpoint.
fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    Ok(body)
}
