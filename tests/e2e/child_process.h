// ChildProcess: a Pith binary started by a test, its output in a log file, killed (SIGKILL)
// when the object goes unless it was stopped first. WaitReady() reads the ports from the
// "ready: grpc_port=N metrics_port=M" line every Pith server logs.
#ifndef PITH_TESTS_E2E_CHILD_PROCESS_H_
#define PITH_TESTS_E2E_CHILD_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace pith::testing {

class ChildProcess {
 public:
  ChildProcess(const std::string& binary, const std::vector<std::string>& args,
               const std::string& log_path)
      : log_path_(log_path) {
    pid_ = fork();
    if (pid_ == 0) {
      int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>(binary.c_str()));
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(binary.c_str(), argv.data());
      _exit(127);
    }
  }
  ~ChildProcess() { Kill(); }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }

  // The process's peak resident set (VmHWM in /proc), in bytes; 0 once it has ended.
  uint64_t PeakRss() const {
    std::ifstream status("/proc/" + std::to_string(pid_) + "/status");
    std::string line;
    while (pid_ > 0 && std::getline(status, line)) {
      if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
    }
    return 0;
  }

  // Waits (up to `seconds`) for the ready line; false if the process died or never said it.
  bool WaitReady(double seconds = 20) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    const std::regex ready("ready: grpc_port=([0-9]+) metrics_port=(-?[0-9]+)");
    while (std::chrono::steady_clock::now() < deadline) {
      std::smatch m;
      const std::string log = Log();
      if (std::regex_search(log, m, ready)) {
        grpc_port = std::stoi(m[1]);
        metrics_port = std::stoi(m[2]);
        return true;
      }
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  std::string Log() const {
    std::ifstream f(log_path_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

  // SIGKILL and reap.
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  // The exit status Running() saw (128 + signal for a signal), or -1.
  int exit_status() const { return exit_status_; }

  // Whether the process is still running (false once it has exited, been killed or reaped).
  bool Running() {
    if (pid_ <= 0) return false;
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      pid_ = -1;
      return false;
    }
    return true;
  }

  // Waits for the process to exit by itself; returns its exit status (or -1 on timeout,
  // after which it is killed).
  int Wait(double seconds) {
    if (pid_ <= 0) return -1;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < deadline) {
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    Kill();
    return -1;
  }

  // SIGTERM; returns the exit status (or -1 on timeout, after which it is killed). A clean
  // stop may wait for the disk (a store's last sync point) while other tests load it.
  int Terminate(double seconds = 30) {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < deadline) {
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    Kill();
    return -1;
  }

  // Resident set size in bytes (0 if unknown).
  uint64_t RssBytes() const {
    std::ifstream f("/proc/" + std::to_string(pid_) + "/status");
    std::string line;
    while (std::getline(f, line)) {
      if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
    }
    return 0;
  }

  int grpc_port = -1;
  int metrics_port = -1;

 private:
  std::string log_path_;
  pid_t pid_ = -1;
  int exit_status_ = -1;  // set by Running() when it reaps the process
};

}  // namespace pith::testing

#endif  // PITH_TESTS_E2E_CHILD_PROCESS_H_
