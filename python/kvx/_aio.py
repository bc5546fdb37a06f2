"""``await`` for kvx's Pending: resolves an asyncio future from the engine's completion callback."""

import asyncio


async def wait_async(pending):
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def resolve():
        if fut.done():
            return
        try:
            fut.set_result(pending.wait(0))
        except BaseException as e:  # the request's own error, raised to the awaiting task
            fut.set_exception(e)

    pending.add_done_callback(lambda: loop.call_soon_threadsafe(resolve))
    return await fut
