// An endpoint to a host that stopped answering is made at once, and its failure arrives
// later as an endpoint error, while the progress thread goes on with other work. UCX 1.13's
// blocking TCP connect held the progress thread for the kernel's ARP timeout instead (see
// kDefaultTcpConnectNonBlocking). Root only: the test moves into a network namespace of its
// own, where an on-link address that nobody answers is made with a veth pair.
#include <sched.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/ucx.h"
#include "gtest/gtest.h"

namespace pith::ucx {
namespace {

// A worker on TCP over `device` alone.
std::unique_ptr<Worker> TcpWorkerOn(const char* device) {
  ::setenv("UCX_TLS", "tcp", 1);
  ::setenv("UCX_NET_DEVICES", device, 1);
  auto w = Worker::Create();
  ::unsetenv("UCX_TLS");
  ::unsetenv("UCX_NET_DEVICES");
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(*w) : nullptr;
}

TEST(UcxConnectTest, AnUnansweringPeerNeitherBlocksTheProgressThreadNorHangs) {
  // A network namespace, and a mount namespace whose /sys shows it (UCX finds devices
  // there), as `ip netns exec` makes; skipped where they cannot be made.
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: the test makes a network namespace";
  if (::unshare(CLONE_NEWNET | CLONE_NEWNS) != 0 ||
      ::mount("", "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0 ||
      ::umount2("/sys", MNT_DETACH) != 0 || ::mount("sysfs", "/sys", "sysfs", 0, nullptr) != 0) {
    GTEST_SKIP() << "cannot make a network namespace with its own /sys: " << std::strerror(errno);
  }
  if (std::system("ip link set lo up && ip link add pc0 type veth peer name pc1 && "
                  "ip addr add 10.77.0.1/24 dev pc0 && ip addr add 10.77.0.2/24 dev pc1 && "
                  "ip link set pc0 up && ip link set pc1 up") != 0) {
    GTEST_SKIP() << "cannot make a veth pair with iproute2 here";
  }
  // UCX takes a device only once its link is up: a veth's carrier comes a moment after.
  for (int i = 0; i < 100 && std::system("grep -qx up /sys/class/net/pc0/operstate && "
                                         "grep -qx up /sys/class/net/pc1/operstate") != 0;
       ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  // Declared before the workers, which may call back into them until they stop.
  absl::Notification failed, send_done, ran;
  absl::Status endpoint_error, send_status;
  absl::Duration connect_took;
  std::unique_ptr<Worker> peer = TcpWorkerOn("pc1");  // its address names 10.77.0.2
  std::unique_ptr<Worker> self = TcpWorkerOn("pc0");
  ASSERT_NE(peer, nullptr);
  ASSERT_NE(self, nullptr);
  // Nobody answers for 10.77.0.2 now: a connect to it waits for ARP, which never comes.
  ASSERT_EQ(std::system("ip addr del 10.77.0.2/24 dev pc1"), 0);
  ASSERT_TRUE(self->Start().ok());
  self->RunSync([&] {
    const absl::Time start = absl::Now();
    absl::StatusOr<ucp_ep_h> ep = self->Connect(peer->address(), [&](absl::Status s) {
      endpoint_error = s;
      failed.Notify();
    });
    connect_took = absl::Now() - start;
    if (!ep.ok()) {  // refused at once: as good, if it says why
      endpoint_error = send_status = ep.status();
      failed.Notify();
      send_done.Notify();
      return;
    }
    self->Send(*ep, 1, "hello", nullptr, 0, nullptr, false, [&](absl::Status s) {
      send_status = s;
      send_done.Notify();
    });
  });
  EXPECT_LT(connect_took, absl::Milliseconds(500)) << "the connect held the progress thread";
  // The progress thread is free for other work while the connection is pending.
  const absl::Time posted = absl::Now();
  self->Post([&] { ran.Notify(); });
  ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(2)));
  EXPECT_LT(absl::Now() - posted, absl::Milliseconds(500));
  // And the failure arrives, as an endpoint error, bounded.
  ASSERT_TRUE(failed.WaitForNotificationWithTimeout(absl::Seconds(30)))
      << "no endpoint error for an unreachable peer";
  EXPECT_FALSE(endpoint_error.ok());
  ASSERT_TRUE(send_done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_FALSE(send_status.ok());
  self->Stop();
}

}  // namespace
}  // namespace pith::ucx
