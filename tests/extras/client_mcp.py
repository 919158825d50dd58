"""agentjet-client[mcp] alone: ``agentjet-client mcp`` over stdio, driven by the official mcp client."""

import asyncio
import sys
import tempfile

from _smoke import BIN
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


async def main() -> list[str]:
    root = tempfile.mkdtemp(prefix="agentjet-smoke-mcp-")
    command = StdioServerParameters(command=str(BIN / "agentjet-client"), args=["mcp", "--root", root])
    async with stdio_client(command) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        names = sorted(tool.name for tool in (await session.list_tools()).tools)
        answer = await session.call_tool("list_studies", {})
        assert not answer.isError, answer
    return names


try:
    tools = asyncio.run(asyncio.wait_for(main(), 120))
except Exception as exc:  # the server's own words are on stderr above; say what the client saw
    sys.exit(f"the MCP client could not use `agentjet-client mcp`: {type(exc).__name__}: {exc}")
assert {"list_studies", "start_study", "run_status"} <= set(tools), tools
print(f"mcp: `agentjet-client mcp` lists {len(tools)} tools to the official client and answers list_studies")
